//! A cpio "newc" archive writer: the format of Linux initramfs archives.
//!
//! Written here: the format is a 110-byte ASCII header per entry, and the
//! archive must be reproducible (fixed owners and times), which takes less
//! code than adapting a general-purpose archiver. The image build's
//! initramfs (`cargo xtask image`) and the nested host's level-1 initramfs
//! both use it.

use std::io::Write;

/// Writes a newc archive entry by entry; [`Cpio::finish`] adds the trailer.
#[derive(Debug)]
pub struct Cpio<W: Write> {
    out: W,
    inode: u32,
}

impl<W: Write> Cpio<W> {
    pub fn new(out: W) -> Self {
        Self { out, inode: 1 }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) -> std::io::Result<()> {
        let size = u32::try_from(data.len()).map_err(|_| std::io::Error::other("file too large for cpio"))?;
        let name_size = u32::try_from(name.len() + 1).map_err(|_| std::io::Error::other("name too long"))?;
        let fields = [self.inode, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, name_size, 0];
        self.inode += 1;
        let mut header = String::from("070701");
        for field in fields {
            header.push_str(&format!("{field:08x}"));
        }
        self.out.write_all(header.as_bytes())?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        self.pad(110 + name.len() + 1)?;
        self.out.write_all(data)?;
        self.pad(data.len())
    }

    fn pad(&mut self, written: usize) -> std::io::Result<()> {
        let padding = (4 - written % 4) % 4;
        self.out.write_all(&[0; 3][..padding])
    }

    pub fn dir(&mut self, name: &str) -> std::io::Result<()> {
        self.entry(name, 0o040_755, &[])
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> std::io::Result<()> {
        self.entry(name, 0o100_000 | mode, data)
    }

    /// A symbolic link `name` → `target`.
    pub fn symlink(&mut self, name: &str, target: &str) -> std::io::Result<()> {
        self.entry(name, 0o120_777, target.as_bytes())
    }

    /// Writes the trailer and returns the writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.entry("TRAILER!!!", 0, &[])?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_entries_are_aligned_and_parse_with_cpio() {
        let mut cpio = Cpio::new(Vec::new());
        cpio.dir("d").expect("dir");
        cpio.file("d/f", 0o644, b"hello").expect("file");
        cpio.symlink("d/l", "f").expect("symlink");
        let archive = cpio.finish().expect("finish");
        assert_eq!(archive.len() % 4, 0);
        assert!(archive.starts_with(b"070701"));
        // Let the real cpio(1) list it when it is installed.
        if let Ok(mut child) = std::process::Command::new("cpio")
            .args(["-tv", "--quiet"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
        {
            child.stdin.take().expect("stdin").write_all(&archive).expect("write");
            let out = child.wait_with_output().expect("cpio runs");
            let listing = String::from_utf8_lossy(&out.stdout);
            let names: Vec<&str> = listing.lines().filter_map(|l| l.split_whitespace().nth(8)).collect();
            assert_eq!(names, ["d", "d/f", "d/l"], "{listing}");
            assert!(listing.contains("d/l -> f"), "{listing}");
        }
    }
}
