//! Certificate authorities a sandbox trusts beyond its image's:
//! `MOAT_CA_FILE`.
//!
//! A host whose outbound HTTPS is re-signed by a local CA (a TLS-inspecting
//! proxy) trusts that CA; a sandbox made from a stock image does not, so
//! `curl`, `pip` and `npm` in it fail with "self-signed certificate in
//! certificate chain". The operator names the CA's certificates in
//! `MOAT_CA_FILE`; every new sandbox gets them in its system store (the
//! bundle OpenSSL, curl, git, Go and Python's `ssl` read) and in the
//! variables of the tools that keep their own (`REQUESTS_CA_BUNDLE`,
//! `PIP_CERT`, `NODE_EXTRA_CA_CERTS`, `SSL_CERT_FILE`).
//!
//! [`untrusted_by_image`] tells `moat doctor` which CAs the host trusts
//! and an image does not.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use moat_proto::{AgentClient, ExecRequest, UnixConnector, WriteFileRequest};

use crate::error::ConfigError;

/// The variable that names the operator's extra CA certificates.
pub const CA_FILE_ENV: &str = "MOAT_CA_FILE";

/// The largest `MOAT_CA_FILE` read (Debian's whole bundle is 220 KiB).
pub const MAX_CA_FILE_BYTES: u64 = 1 << 20;

/// Where the extra certificates are put in a sandbox, alone (Debian's
/// place for local CAs; `NODE_EXTRA_CA_CERTS` names it).
pub const SANDBOX_CA_FILE: &str = "/usr/local/share/ca-certificates/moat-extra.crt";

/// The system bundle, in the sandbox and on a Debian host; the extra
/// certificates are appended to the sandbox's.
pub const BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Where Debian keeps the CAs an administrator added to the host's store.
pub const LOCAL_CAS: &str = "/usr/local/share/ca-certificates";

/// The operator's extra CA certificates, checked and re-encoded (only the
/// certificate blocks are kept).
#[derive(Debug, Clone)]
pub struct ExtraCa {
    /// The file they were read from.
    pub source: PathBuf,
    /// How many certificates.
    pub certificates: usize,
    pem: Arc<str>,
}

impl ExtraCa {
    /// `MOAT_CA_FILE`'s certificates; `None` when it is unset or empty.
    /// A file that is missing, too large or holds no certificate is the
    /// operator's error (the binaries exit with 2).
    pub fn from_env() -> Result<Option<Self>, ConfigError> {
        match std::env::var_os(CA_FILE_ENV) {
            Some(path) if !path.is_empty() => Self::load(Path::new(&path))
                .map(Some)
                .map_err(|why| ConfigError::Invalid(format!("{CA_FILE_ENV}={}: {why}", Path::new(&path).display()))),
            _ => Ok(None),
        }
    }

    /// Reads and checks a PEM file of CA certificates.
    pub fn load(path: &Path) -> Result<Self, String> {
        use std::io::Read;
        let file = std::fs::File::open(path).map_err(|e| format!("cannot be read ({e})"))?;
        let mut bytes = Vec::new();
        file.take(MAX_CA_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot be read ({e})"))?;
        if bytes.len() as u64 > MAX_CA_FILE_BYTES {
            return Err(format!(
                "is larger than {} KiB; give only the CA certificates to add",
                MAX_CA_FILE_BYTES >> 10
            ));
        }
        let pem = certificates(&bytes)?;
        Ok(Self {
            source: path.to_path_buf(),
            certificates: pem.len(),
            pem: pem::encode_many_config(&pem, pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF)).into(),
        })
    }

    /// The certificates, PEM-encoded.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The variables every process in the sandbox gets, for the tools that
    /// do not read the system store.
    pub fn env() -> Vec<(String, String)> {
        [
            ("SSL_CERT_FILE", BUNDLE),
            ("REQUESTS_CA_BUNDLE", BUNDLE),
            ("PIP_CERT", BUNDLE),
            ("NODE_EXTRA_CA_CERTS", SANDBOX_CA_FILE),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    /// Adds the certificates to a new sandbox's system store, through its
    /// agent (the same for jails and microVMs): [`SANDBOX_CA_FILE`], then
    /// appended to [`BUNDLE`]. Error text says which step failed.
    pub async fn install(&self, client: &AgentClient<UnixConnector>) -> Result<(), String> {
        let request = WriteFileRequest {
            path: SANDBOX_CA_FILE.into(),
            mode: Some(0o644),
            create_parents: true,
            owner: Some("root".into()),
        };
        client
            .write_file(request, &mut self.pem.as_bytes())
            .await
            .map_err(|e| format!("writing {SANDBOX_CA_FILE}: {e}"))?;
        let mut append = ExecRequest::argv(["/bin/sh", "-c", &format!("cat {SANDBOX_CA_FILE} >> {BUNDLE}")]);
        append.user = Some("root".into());
        let out = client.run(append).await.map_err(|e| format!("adding them to {BUNDLE}: {e}"))?;
        if out.status.code != Some(0) {
            return Err(format!("adding them to {BUNDLE}: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(())
    }
}

/// The certificate blocks of a PEM file. A private key is refused (the CA's
/// certificate is what a sandbox trusts; its key must not travel), and so
/// is a file with no certificate or one whose blocks are not DER.
fn certificates(bytes: &[u8]) -> Result<Vec<pem::Pem>, String> {
    let blocks = pem::parse_many(bytes).map_err(|e| format!("is not a PEM file ({e})"))?;
    if blocks.iter().any(|b| b.tag().contains("PRIVATE KEY")) {
        return Err("holds a private key: give only the CA's certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    let certificates: Vec<pem::Pem> = blocks.into_iter().filter(|b| b.tag() == "CERTIFICATE").collect();
    if certificates.is_empty() {
        return Err("holds no certificate: it must be PEM, one or more -----BEGIN CERTIFICATE----- blocks".into());
    }
    // An X.509 certificate is a DER SEQUENCE.
    if let Some(at) = certificates.iter().position(|c| c.contents().first() != Some(&0x30)) {
        return Err(format!("certificate {} is not DER-encoded X.509", at + 1));
    }
    Ok(certificates)
}

/// CAs a host's administrator added to its trust store that an image
/// does not trust. (The stock CAs of host and image differ with their
/// `ca-certificates` versions; those are not counted.)
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Untrusted {
    /// How many certificates of the host's local CA files are in the
    /// host's bundle and not in the image's.
    pub count: usize,
    /// The local CA files ([`LOCAL_CAS`]) that hold them: what to name in
    /// `MOAT_CA_FILE`.
    pub files: Vec<PathBuf>,
}

/// Which of the CAs added in `local_dir` and trusted in `host_bundle` the
/// bundle under `image_root` lacks. `None` when the
/// image has no bundle to compare with; an unreadable host bundle counts
/// as empty.
pub fn untrusted_by_image(host_bundle: &Path, local_dir: &Path, image_root: &Path) -> Option<Untrusted> {
    let read = |path: &Path| -> Vec<Vec<u8>> {
        std::fs::read(path)
            .ok()
            .and_then(|b| certificates(&b).ok())
            .map(|c| c.into_iter().map(pem::Pem::into_contents).collect())
            .unwrap_or_default()
    };
    let image: std::collections::HashSet<Vec<u8>> =
        read(&image_root.join(BUNDLE.trim_start_matches('/'))).into_iter().collect();
    if image.is_empty() {
        return None;
    }
    let host: std::collections::HashSet<Vec<u8>> = read(host_bundle).into_iter().collect();
    let mut untrusted = Untrusted::default();
    let mut seen = std::collections::HashSet::new();
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(local_dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
    files.sort();
    for file in files {
        let missing: Vec<Vec<u8>> =
            read(&file).into_iter().filter(|c| host.contains(c) && !image.contains(c)).collect();
        if !missing.is_empty() {
            untrusted.files.push(file);
        }
        untrusted.count += missing.into_iter().filter(|c| seen.insert(c.clone())).count();
    }
    Some(untrusted)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed CA certificate made by `openssl req -x509`, as PEM.
    fn made_ca(dir: &Path, name: &str) -> Vec<u8> {
        let status = std::process::Command::new("openssl")
            .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj"])
            .arg(format!("/CN={name}"))
            .arg("-keyout")
            .arg(dir.join(format!("{name}.key")))
            .arg("-out")
            .arg(dir.join(format!("{name}.crt")))
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl runs");
        assert!(status.success());
        std::fs::read(dir.join(format!("{name}.crt"))).expect("the certificate")
    }

    #[test]
    fn certificates_are_kept_and_everything_else_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let one = made_ca(dir.path(), "one");
        let two = made_ca(dir.path(), "two");
        let both = dir.path().join("both.pem");
        std::fs::write(&both, [b"# a comment line\n".as_slice(), &one, &two].concat()).expect("writes");
        let ca = ExtraCa::load(&both).expect("two certificates");
        assert_eq!(ca.certificates, 2);
        assert_eq!(ca.pem().matches("-----BEGIN CERTIFICATE-----").count(), 2);
        assert!(!ca.pem().contains("comment"));

        let refused = |bytes: &[u8]| {
            let path = dir.path().join("bad.pem");
            std::fs::write(&path, bytes).expect("writes");
            ExtraCa::load(&path).expect_err("refused")
        };
        let key = std::fs::read(dir.path().join("one.key")).expect("key");
        assert!(refused(&[one.clone(), key].concat()).contains("private key"));
        assert!(refused(b"not a certificate\n").contains("holds no certificate"));
        let not_der = pem::encode(&pem::Pem::new("CERTIFICATE", b"hello".to_vec()));
        assert!(refused(not_der.as_bytes()).contains("not DER"));
        let huge = vec![b'#'; usize::try_from(MAX_CA_FILE_BYTES + 1).expect("fits")];
        assert!(refused(&huge).contains("larger than 1024 KiB"));
        let missing = ExtraCa::load(&dir.path().join("none.pem")).expect_err("missing");
        assert!(missing.contains("cannot be read"), "{missing}");
    }

    #[test]
    fn the_cas_a_host_adds_are_named_with_their_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let stock = made_ca(dir.path(), "stock");
        let local = made_ca(dir.path(), "local");
        let image = dir.path().join("image");
        let bundle = image.join(BUNDLE.trim_start_matches('/'));
        std::fs::create_dir_all(bundle.parent().expect("parent")).expect("dirs");
        std::fs::write(&bundle, &stock).expect("writes");
        let locals = dir.path().join("local-cas");
        std::fs::create_dir(&locals).expect("dir");
        std::fs::write(locals.join("corp.crt"), &local).expect("writes");
        std::fs::write(locals.join("other.crt"), &stock).expect("writes");
        let host = dir.path().join("host.crt");

        // A stock CA of the host's newer list, not added by its administrator.
        let newer = made_ca(dir.path(), "newer");
        std::fs::write(&host, [stock.clone(), local.clone(), newer].concat()).expect("writes");
        let found = untrusted_by_image(&host, &locals, &image);
        assert_eq!(found, Some(Untrusted { count: 1, files: vec![locals.join("corp.crt")] }));

        // A local file the host's bundle does not hold (not yet made
        // trusted with update-ca-certificates) is not the image's lack.
        std::fs::write(&host, &stock).expect("writes");
        assert_eq!(untrusted_by_image(&host, &locals, &image), Some(Untrusted::default()));
        std::fs::write(&host, [stock.clone(), local].concat()).expect("writes");

        assert_eq!(untrusted_by_image(&host, &locals, &dir.path().join("no-image")), None);
    }
}
