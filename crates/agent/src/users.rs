//! Users and groups from the sandbox's own `/etc/passwd` and `/etc/group`.
//!
//! Parsed by hand rather than through `getpwnam(3)`: the agent is linked
//! statically, and glibc's NSS cannot load its modules in a static binary.

use std::path::{Path, PathBuf};

use moat_proto::{ErrorKind, WireError};

/// Who a process runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserEntry {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
    /// Supplementary groups, from `/etc/group`.
    pub groups: Vec<u32>,
}

/// Resolves a user given by name or numeric uid.
pub fn lookup(spec: &str) -> Result<UserEntry, WireError> {
    lookup_in(Path::new("/etc"), spec)
}

/// The user the agent itself runs as.
pub fn current() -> UserEntry {
    let uid = nix::unistd::geteuid().as_raw();
    lookup_in(Path::new("/etc"), &uid.to_string()).unwrap_or_else(|_| numeric(uid))
}

fn numeric(uid: u32) -> UserEntry {
    UserEntry { name: uid.to_string(), uid, gid: uid, home: "/".into(), shell: "/bin/sh".into(), groups: Vec::new() }
}

fn lookup_in(etc: &Path, spec: &str) -> Result<UserEntry, WireError> {
    let passwd = std::fs::read_to_string(etc.join("passwd")).unwrap_or_default();
    let by_uid = spec.parse::<u32>().ok();
    let found = passwd.lines().filter_map(parse_passwd_line).find(|u| match by_uid {
        Some(uid) => u.uid == uid,
        None => u.name == spec,
    });
    let mut user = match (found, by_uid) {
        (Some(user), _) => user,
        (None, Some(uid)) => numeric(uid),
        (None, None) => {
            return Err(WireError::new(
                ErrorKind::NotFound,
                format!("no user {spec:?} in /etc/passwd; give an existing user name or a numeric uid"),
            ));
        }
    };
    let group = std::fs::read_to_string(etc.join("group")).unwrap_or_default();
    user.groups = supplementary_groups(&group, &user.name, user.gid);
    Ok(user)
}

fn parse_passwd_line(line: &str) -> Option<UserEntry> {
    let mut fields = line.split(':');
    let name = fields.next()?.to_owned();
    let _password = fields.next()?;
    let uid = fields.next()?.parse().ok()?;
    let gid = fields.next()?.parse().ok()?;
    let _gecos = fields.next()?;
    let home = PathBuf::from(fields.next()?);
    let shell = fields.next().unwrap_or("/bin/sh").to_owned();
    Some(UserEntry { name, uid, gid, home, shell, groups: Vec::new() })
}

fn supplementary_groups(group_file: &str, user: &str, primary: u32) -> Vec<u32> {
    let mut groups = vec![primary];
    for line in group_file.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if let [_, _, gid, members] = fields[..]
            && members.split(',').any(|m| m == user)
            && let Ok(gid) = gid.parse()
            && !groups.contains(&gid)
        {
            groups.push(gid);
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn etc() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("passwd"),
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000:,,,:/home/user:/bin/bash\nbroken line\n",
        )
        .expect("write passwd");
        std::fs::write(dir.path().join("group"), "root:x:0:\nuser:x:1000:\naudio:x:29:user,other\nvideo:x:44:other\n")
            .expect("write group");
        dir
    }

    #[test]
    fn finds_users_by_name_and_uid() {
        let etc = etc();
        let user = lookup_in(etc.path(), "user").expect("user exists");
        assert_eq!((user.uid, user.gid, user.home.as_path()), (1000, 1000, Path::new("/home/user")));
        assert_eq!(user.groups, vec![1000, 29]);
        assert_eq!(lookup_in(etc.path(), "0").expect("root").name, "root");
    }

    #[test]
    fn unknown_names_are_errors_but_numeric_uids_work() {
        let etc = etc();
        assert_eq!(lookup_in(etc.path(), "nobody-here").expect_err("unknown").kind, ErrorKind::NotFound);
        let anon = lookup_in(etc.path(), "4242").expect("numeric uid");
        assert_eq!((anon.uid, anon.gid), (4242, 4242));
    }
}
