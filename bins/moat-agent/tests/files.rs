//! The real agent binary on a Unix socket, driven by the `moat-proto` client:
//! files, tar streams and port forwards.

// Test data is generated with `as u8` on purpose.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::TestAgent;
use moat_proto::{ErrorKind, FileKind, ReadFileRequest, WriteFileRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn write_req(path: &str) -> WriteFileRequest {
    WriteFileRequest { path: path.into(), mode: None, create_parents: false, owner: None }
}

fn read_req(path: &str) -> ReadFileRequest {
    ReadFileRequest { path: path.into(), offset: 0, length: None }
}

#[tokio::test]
async fn binary_files_round_trip_with_ranges() {
    let agent = TestAgent::start().await;
    let client = agent.client();
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let path = agent.path("deep/er/blob.bin");
    let mut req = write_req(&path);
    req.create_parents = true;
    req.mode = Some(0o600);
    assert_eq!(client.write_file(req, &mut data.as_slice()).await.expect("writes"), data.len() as u64);
    assert_eq!(client.read_file(read_req(&path)).await.expect("reads"), data);
    let range = ReadFileRequest { path: path.clone(), offset: 999_990, length: Some(100) };
    assert_eq!(client.read_file(range).await.expect("range"), &data[999_990..]);
    let info = client.stat(&path).await.expect("stat");
    assert_eq!((info.kind, info.size, info.mode, info.name.as_str()), (FileKind::File, 1_000_000, 0o600, "blob.bin"));

    // Replacing keeps the old mode; an empty file is a file too.
    client.write_file(write_req(&path), &mut &b""[..]).await.expect("truncates");
    let info = client.stat(&path).await.expect("stat");
    assert_eq!((info.size, info.mode), (0, 0o600));
}

#[tokio::test]
async fn an_abandoned_write_leaves_the_old_file() {
    let agent = TestAgent::start().await;
    let path = agent.path("keep.txt");
    std::fs::write(&path, "original").expect("seed");
    // Speak the protocol by hand and hang up mid-upload.
    let stream = tokio::net::UnixStream::connect(&agent.socket).await.expect("connect");
    let mut conn = moat_proto::Connection::new(stream);
    conn.send(&moat_proto::ClientMsg::Hello { version: moat_proto::PROTOCOL_VERSION, client: "test".into() })
        .await
        .expect("hello");
    let request = moat_proto::Request::WriteFile(write_req(&path));
    conn.send(&moat_proto::ClientMsg::Request { request }).await.expect("request");
    conn.send_data(moat_proto::StreamId::Input, bytes::Bytes::from_static(b"half of the new")).await.expect("data");
    drop(conn);
    // The agent still serves, the file is intact, no temporary file is left.
    let client = agent.client();
    client.info().await.expect("agent alive");
    assert_eq!(std::fs::read_to_string(&path).expect("read"), "original");
    // The abandoned connection is served on a task of its own, which sees
    // the hang-up when it next reads: give it a while (a bound on an event,
    // not a measure of speed) to remove its temporary file.
    let leftovers = || -> Vec<_> {
        std::fs::read_dir(agent.dir())
            .expect("list")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with(".moat-write-"))
            .map(|e| e.path())
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !leftovers().is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(leftovers().is_empty(), "{:?}", leftovers());
    assert_eq!(std::fs::read_to_string(&path).expect("read"), "original");
}

#[tokio::test]
async fn file_errors_say_what_went_wrong() {
    let agent = TestAgent::start().await;
    let client = agent.client();
    let missing = agent.path("missing.txt");
    let err = client.read_file(read_req(&missing)).await.expect_err("not found");
    assert_eq!(err.kind(), Some(ErrorKind::NotFound));
    assert!(err.to_string().contains("missing.txt: no such file"), "{err}");

    let dir = agent.dir().to_string_lossy().into_owned();
    assert_eq!(client.read_file(read_req(&dir)).await.expect_err("dir").kind(), Some(ErrorKind::IsADirectory));
    assert_eq!(
        client.write_file(write_req(&dir), &mut &b"x"[..]).await.expect_err("dir").kind(),
        Some(ErrorKind::IsADirectory)
    );

    let file = agent.path("plain");
    std::fs::write(&file, "x").expect("seed");
    let under_file = format!("{file}/child");
    assert_eq!(client.stat(&under_file).await.expect_err("enotdir").kind(), Some(ErrorKind::NotADirectory));
    assert_eq!(client.list_dir(&file, 1).await.expect_err("enotdir").kind(), Some(ErrorKind::NotADirectory));

    // Without create_parents a missing parent is an error, and the agent
    // refused before taking the upload.
    let orphan = agent.path("no/parent.txt");
    let big = vec![1u8; 8 << 20];
    let err = client.write_file(write_req(&orphan), &mut big.as_slice()).await.expect_err("no parent");
    assert_eq!(err.kind(), Some(ErrorKind::NotFound), "{err}");

    // A file too large for one read asks for a range.
    let sparse = agent.path("sparse");
    std::fs::File::create(&sparse).and_then(|f| f.set_len(2 << 30)).expect("sparse file");
    let err = client.read_file(read_req(&sparse)).await.expect_err("too large");
    assert_eq!(err.kind(), Some(ErrorKind::TooLarge));
    assert!(err.to_string().contains("offset and length"), "{err}");
    let range = ReadFileRequest { path: sparse, offset: 1 << 30, length: Some(4) };
    assert_eq!(client.read_file(range).await.expect("range of a huge file"), vec![0; 4]);

    // A FIFO no one writes to, and a device: refused at once, never
    // waited on (before, the read of the FIFO never returned).
    let fifo = agent.path("fifo");
    nix::unistd::mkfifo(fifo.as_str(), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
    for special in [fifo.as_str(), "/dev/zero"] {
        let err = tokio::time::timeout(std::time::Duration::from_secs(20), client.read_file(read_req(special)))
            .await
            .unwrap_or_else(|_| panic!("reading {special} waited"))
            .expect_err("not a regular file");
        assert_eq!(err.kind(), Some(ErrorKind::InvalidRequest), "{err}");
        assert!(err.to_string().contains("not a regular file") && err.to_string().contains("run_command"), "{err}");
    }
    // Archived as what it is, its content never read.
    let mut one = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(20), client.tar_out(fifo.as_str(), &mut one))
        .await
        .expect("archiving a FIFO waited")
        .expect("a FIFO archived");
    let mut archive = tar::Archive::new(one.as_slice());
    let kinds: Vec<tar::EntryType> =
        archive.entries().expect("entries").map(|e| e.expect("entry").header().entry_type()).collect();
    assert_eq!(kinds, vec![tar::EntryType::Fifo]);

    for bad in ["relative/path", "", "/with\0nul"] {
        assert_eq!(client.stat(bad).await.expect_err(bad).kind(), Some(ErrorKind::InvalidPath), "{bad:?}");
    }
    assert_eq!(client.list_dir(&dir, 0).await.expect_err("depth").kind(), Some(ErrorKind::InvalidRequest));
    assert_eq!(client.list_dir(&dir, 6).await.expect_err("depth").kind(), Some(ErrorKind::InvalidRequest));
    let err = client.remove("/", true).await.expect_err("root");
    assert_eq!(err.kind(), Some(ErrorKind::InvalidPath));
}

#[tokio::test]
async fn permission_denied_for_an_unprivileged_agent() {
    // The agent itself as `nobody`: root-only files are out of its reach.
    let agent = TestAgent::start_with(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], &[]).await;
    let err = agent.client().read_file(read_req("/etc/shadow")).await.expect_err("denied");
    assert_eq!(err.kind(), Some(ErrorKind::PermissionDenied), "{err}");
}

#[tokio::test]
async fn directories_list_mkdir_move_remove() {
    let agent = TestAgent::start().await;
    let client = agent.client();
    let root = agent.path("tree");
    client.make_dir(format!("{root}/a/b/c"), None).await.expect("mkdir -p");
    client.make_dir(format!("{root}/a/b/c"), None).await.expect("mkdir -p again is fine");
    std::fs::write(format!("{root}/a/file.txt"), "hello").expect("seed");
    std::os::unix::fs::symlink("file.txt", format!("{root}/a/link")).expect("symlink");

    let (entries, truncated) = client.list_dir(&root, 1).await.expect("list");
    assert!(!truncated);
    assert_eq!(entries.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(), ["a"]);
    let (entries, _) = client.list_dir(&root, 5).await.expect("list deep");
    let names: Vec<_> = entries.iter().map(|e| e.path.strip_prefix(&root).unwrap_or(&e.path)).collect();
    assert_eq!(names, ["/a", "/a/b", "/a/b/c", "/a/file.txt", "/a/link"]);
    let link = entries.iter().find(|e| e.name == "link").expect("link listed");
    assert_eq!((link.kind, link.link_target.as_deref()), (FileKind::Symlink, Some("file.txt")));
    let file = entries.iter().find(|e| e.name == "file.txt").expect("file listed");
    assert_eq!((file.kind, file.size), (FileKind::File, 5));

    client.move_path(format!("{root}/a/file.txt"), format!("{root}/moved.txt"), false).await.expect("moves");
    std::fs::write(format!("{root}/other.txt"), "x").expect("seed");
    let err = client.move_path(format!("{root}/other.txt"), format!("{root}/moved.txt"), false).await;
    assert_eq!(err.expect_err("exists").kind(), Some(ErrorKind::AlreadyExists));
    client.move_path(format!("{root}/other.txt"), format!("{root}/moved.txt"), true).await.expect("overwrites");
    assert_eq!(std::fs::read_to_string(format!("{root}/moved.txt")).expect("read"), "x");

    let err = client.remove(format!("{root}/a"), false).await.expect_err("not empty");
    assert_eq!(err.kind(), Some(ErrorKind::DirectoryNotEmpty));
    client.remove(format!("{root}/a"), true).await.expect("rm -r");
    assert!(!Path::new(&format!("{root}/a")).exists());
    client.remove(format!("{root}/moved.txt"), false).await.expect("rm");
    assert_eq!(
        client.remove(format!("{root}/moved.txt"), false).await.expect_err("gone").kind(),
        Some(ErrorKind::NotFound)
    );
}

#[tokio::test]
async fn non_utf8_names_are_listed_lossily() {
    use std::os::unix::ffi::OsStrExt;
    let agent = TestAgent::start().await;
    let dir = agent.dir().join("odd");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::write(dir.join(std::ffi::OsStr::from_bytes(b"caf\xe9")), "x").expect("odd name");
    let (entries, _) = agent.client().list_dir(dir.to_string_lossy(), 1).await.expect("lists");
    assert_eq!(entries.len(), 1);
    assert!(entries[0].lossy_name);
    assert_eq!(entries[0].name, "caf\u{fffd}");
}

#[tokio::test]
async fn tar_round_trip_keeps_modes_and_symlinks() {
    let agent = TestAgent::start().await;
    let src = agent.dir().join("src");
    std::fs::create_dir_all(src.join("bin")).expect("mkdir");
    std::fs::create_dir_all(src.join("empty")).expect("mkdir");
    std::fs::write(src.join("bin/run.sh"), "#!/bin/sh\necho hi\n").expect("write");
    std::fs::set_permissions(src.join("bin/run.sh"), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::write(src.join("secret"), [0u8, 255, 1, 254]).expect("write");
    std::fs::set_permissions(src.join("secret"), std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::os::unix::fs::symlink("bin/run.sh", src.join("run")).expect("symlink");
    std::os::unix::fs::symlink("/etc/passwd", src.join("outside")).expect("symlink");

    let client = agent.client();
    let mut archive = Vec::new();
    client.tar_out(src.to_string_lossy(), &mut archive).await.expect("tar out");
    let dst = agent.dir().join("dst");
    let entries = client.tar_in(dst.to_string_lossy(), None, &mut archive.as_slice()).await.expect("tar in");
    assert!(entries >= 6, "{entries} entries");

    assert_eq!(std::fs::read(dst.join("secret")).expect("read"), [0, 255, 1, 254]);
    assert_eq!(std::fs::metadata(dst.join("secret")).expect("stat").mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(dst.join("bin/run.sh")).expect("stat").mode() & 0o777, 0o755);
    assert_eq!(std::fs::read_link(dst.join("run")).expect("link"), Path::new("bin/run.sh"));
    assert_eq!(std::fs::read_link(dst.join("outside")).expect("link"), Path::new("/etc/passwd"));
    assert!(dst.join("empty").is_dir());

    // A tree with a FIFO and a socket: the FIFO as its header, never
    // opened, the socket (tar has no type for it) left out, the rest whole.
    let special = agent.dir().join("special");
    std::fs::create_dir_all(&special).expect("mkdir");
    std::fs::write(special.join("data"), "kept").expect("write");
    nix::unistd::mkfifo(&special.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
    let _listening = std::os::unix::net::UnixListener::bind(special.join("sock")).expect("bind");
    let mut archive = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(20), client.tar_out(special.to_string_lossy(), &mut archive))
        .await
        .expect("archiving waited")
        .expect("a tree with a FIFO and a socket archived");
    let mut kinds: Vec<(String, tar::EntryType)> = tar::Archive::new(archive.as_slice())
        .entries()
        .expect("entries")
        .map(|e| e.expect("entry"))
        .map(|e| (e.path().expect("path").to_string_lossy().into_owned(), e.header().entry_type()))
        .collect();
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        kinds,
        [
            (".".to_owned(), tar::EntryType::Directory),
            ("data".to_owned(), tar::EntryType::Regular),
            ("fifo".to_owned(), tar::EntryType::Fifo)
        ]
    );

    // One file tars as that file.
    let mut one = Vec::new();
    client.tar_out(src.join("secret").to_string_lossy(), &mut one).await.expect("tar one file");
    let names: Vec<String> = tar::Archive::new(one.as_slice())
        .entries()
        .expect("entries")
        .map(|e| e.expect("entry").path().expect("path").to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["secret"]);
}

#[tokio::test]
async fn tar_in_refuses_entries_that_escape() {
    let agent = TestAgent::start().await;
    let mut builder = tar::Builder::new(Vec::new());
    let mut add = |name: &str, data: &[u8]| {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        // set_path refuses `..`; write the raw name as a hostile archive would.
        let raw = &mut header.as_old_mut().name;
        raw[..name.len()].copy_from_slice(name.as_bytes());
        header.set_cksum();
        builder.append(&header, data).expect("append");
    };
    add("ok.txt", b"fine");
    add("../escaped.txt", b"bad");
    let archive = builder.into_inner().expect("archive");
    let dst = agent.dir().join("inner/dst");
    agent.client().tar_in(dst.to_string_lossy(), None, &mut archive.as_slice()).await.expect("unpacks the rest");
    assert!(dst.join("ok.txt").exists());
    assert!(!agent.dir().join("inner/escaped.txt").exists());
}

#[tokio::test]
async fn port_forward_splices_to_a_loopback_port() {
    let agent = TestAgent::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        socket.write_all(b"banner\n").await.expect("banner");
        let mut buf = [0u8; 5];
        socket.read_exact(&mut buf).await.expect("read");
        socket.write_all(&buf).await.expect("echo");
    });
    let mut stream = agent.client().port_forward(port).await.expect("forwarded");
    let mut banner = [0u8; 7];
    stream.read_exact(&mut banner).await.expect("banner arrives");
    assert_eq!(&banner, b"banner\n");
    stream.write_all(b"hello").await.expect("write");
    let mut echo = [0u8; 5];
    stream.read_exact(&mut echo).await.expect("echo arrives");
    assert_eq!(&echo, b"hello");
    server.await.expect("server");

    // A closed port is a clear refusal.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let closed_port = closed.local_addr().expect("addr").port();
    drop(closed);
    let err = agent.client().port_forward(closed_port).await.expect_err("refused");
    assert_eq!(err.kind(), Some(ErrorKind::ConnectionRefused));
    assert!(err.to_string().contains("nothing is listening"), "{err}");
}
