//! Who runs moat on the host, and which ids its jails may use.
//!
//! As root, a jail's ids are host ids from [`JAIL_ID_BASE`]. As any other
//! user ("rootless"), they are that user's subordinate range from
//! `/etc/subuid` and `/etc/subgid`, mapped through Debian's `newuidmap` and
//! `newgidmap` (package `uidmap`), as rootless Podman does: sandbox root and
//! `user` are then ids the user owns, neither the user itself nor host root.

use crate::image::{JAIL_ID_BASE, JAIL_ID_COUNT};

/// A subordinate id range: `count` ids from `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub start: u32,
    pub count: u32,
}

/// The user moat runs as, and the ids its jails map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostUser {
    pub uid: u32,
    pub gid: u32,
    /// The login name, when the password database knows the uid; for root
    /// not looked up ahead (see [`HostUser::current`]).
    pub name: Option<String>,
    /// Host uid and gid of sandbox id 0, [`JAIL_ID_COUNT`] ids each: for
    /// root [`JAIL_ID_BASE`]; else the user's first subordinate ranges of
    /// at least that many ids, `None` when it has none.
    pub ids: Option<(Range, Range)>,
}

/// The login name of `uid`, when the password database knows it.
fn login_name(uid: u32) -> Option<String> {
    nix::unistd::User::from_uid(uid.into()).ok().flatten().map(|u| u.name)
}

/// Where subordinate ranges are listed.
const SUBUID: &str = "/etc/subuid";
const SUBGID: &str = "/etc/subgid";

impl HostUser {
    /// The user this process runs as (its effective ids). Root's name is
    /// left to [`HostUser::display_name`]: root maps no subordinate range
    /// by name, and asking the password database (NSS: nscd's socket,
    /// nsswitch.conf, /etc/passwd) cost every `moat run` as root 0.1 ms for
    /// a name that only an error message shows.
    pub fn current() -> Self {
        let uid = nix::unistd::geteuid().as_raw();
        let gid = nix::unistd::getegid().as_raw();
        let name = if uid == 0 { None } else { login_name(uid) };
        let root = Range { start: JAIL_ID_BASE, count: JAIL_ID_COUNT };
        let ids = if uid == 0 {
            Some((root, root))
        } else {
            let read = |file: &str| std::fs::read_to_string(file).unwrap_or_default();
            subordinate(&read(SUBUID), uid, name.as_deref()).zip(subordinate(&read(SUBGID), uid, name.as_deref()))
        };
        Self { uid, gid, name, ids }
    }

    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    /// The name to give `usermod` and `moat setup --user`: the login name,
    /// else the uid.
    pub fn display_name(&self) -> String {
        self.name.clone().or_else(|| login_name(self.uid)).unwrap_or_else(|| self.uid.to_string())
    }

    /// Why this user cannot start jails, with what fixes it; `None` when
    /// it can.
    pub fn jail_problem(&self) -> Option<String> {
        if self.is_root() {
            return None;
        }
        let name = self.display_name();
        if self.ids.is_none() {
            return Some(format!(
                "user {name} has no subordinate id range of {JAIL_ID_COUNT} ids in {SUBUID} and {SUBGID}, which \
                 rootless jails map their users onto; as root, run `moat setup --user {name}` (it picks a free \
                 range, prepares cgroups and the image), or `usermod --add-subuids N-M --add-subgids N-M {name}` \
                 with a free range of {JAIL_ID_COUNT} ids"
            ));
        }
        if let Some((uids, gids)) = self.ids
            && uids.start != gids.start
        {
            return Some(split_ranges(&name, uids, gids));
        }
        for helper in ["newuidmap", "newgidmap"] {
            if crate::programs::find_program(helper).is_none() {
                return Some(format!(
                    "{helper} is not installed; rootless jails map their ids with it: as root, run \
                     `apt-get install uidmap`"
                ));
            }
        }
        None
    }
}

/// Why subordinate uids and gids that start at different ids are refused,
/// and what to do: a jail's image is owned from one id for both (its
/// files' groups shift by the uid range's start), so the groups of a
/// user's image would be ids outside its gid range, which another user
/// may be given.
pub fn split_ranges(name: &str, uids: Range, gids: Range) -> String {
    let end = |r: Range| u64::from(r.start) + u64::from(r.count) - 1;
    format!(
        "user {name}'s subordinate uids start at {} and its gids at {}: a jail's image is owned from one id for \
         both, so its files' groups would be ids outside {name}'s gid range; as root, give {name} gids from the \
         same start (`usermod --del-subgids {}-{} --add-subgids {}-{} {name}`, where that range is no one \
         else's), then run `moat setup --user {name}`",
        uids.start,
        gids.start,
        gids.start,
        end(gids),
        uids.start,
        end(uids)
    )
}

/// The first range of at least [`JAIL_ID_COUNT`] ids that `subid` (the
/// text of `/etc/subuid` or `/etc/subgid`) gives the user `uid` or `name`.
pub fn subordinate(subid: &str, uid: u32, name: Option<&str>) -> Option<Range> {
    subid.lines().find_map(|line| {
        let mut fields = line.trim().split(':');
        let (who, start, count) = (fields.next()?, fields.next()?, fields.next()?);
        let mine = who == uid.to_string() || name.is_some_and(|n| n == who);
        let range = Range { start: start.parse().ok()?, count: count.parse().ok()? };
        (mine && range.count >= JAIL_ID_COUNT && range.start.checked_add(range.count).is_some()).then_some(range)
    })
}

/// Whether `subid` (the text of `/etc/subuid` or `/etc/subgid`) hands
/// out none of `range`'s ids.
pub fn is_free(subid: &str, range: Range) -> bool {
    let (start, end) = (u64::from(range.start), u64::from(range.start) + u64::from(range.count));
    subid.lines().all(|line| {
        let mut fields = line.trim().split(':').skip(1);
        let given =
            (fields.next().and_then(|s| s.parse::<u64>().ok()), fields.next().and_then(|c| c.parse::<u64>().ok()));
        match given {
            (Some(from), Some(count)) => from + count <= start || end <= from,
            _ => true,
        }
    })
}

/// A free range of [`JAIL_ID_COUNT`] ids for a new user: above every
/// range `subuid` and `subgid` hand out (at least from 100000, as
/// `useradd` starts) and below root's jail ids ([`JAIL_ID_BASE`]).
pub fn free_range(subuid: &str, subgid: &str) -> Option<Range> {
    let end = subuid
        .lines()
        .chain(subgid.lines())
        .filter_map(|line| {
            let mut fields = line.trim().split(':').skip(1);
            let start: u64 = fields.next()?.parse().ok()?;
            let count: u64 = fields.next()?.parse().ok()?;
            Some(start + count)
        })
        .max()
        .unwrap_or(0)
        .max(100_000);
    let start = u32::try_from(end).ok()?;
    (u64::from(start) + u64::from(JAIL_ID_COUNT) <= u64::from(JAIL_ID_BASE))
        .then_some(Range { start, count: JAIL_ID_COUNT })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_range_is_found_by_name_or_uid() {
        let subid = "alice:100000:65536\n1001:165536:65536\nbob:300000:1000\nbob:400000:65536\n";
        assert_eq!(subordinate(subid, 1000, Some("alice")), Some(Range { start: 100_000, count: 65536 }));
        assert_eq!(subordinate(subid, 1001, Some("carol")), Some(Range { start: 165_536, count: 65536 }));
        assert_eq!(
            subordinate(subid, 1002, Some("bob")),
            Some(Range { start: 400_000, count: 65536 }),
            "a range too small for a jail is passed over"
        );
        assert_eq!(subordinate(subid, 1003, Some("dave")), None);
        assert_eq!(subordinate("eve:x:65536\neve:4294967295:65536\n", 1, Some("eve")), None, "nonsense is skipped");
    }

    #[test]
    fn a_free_range_lies_above_every_other_and_below_roots() {
        assert_eq!(free_range("", ""), Some(Range { start: 100_000, count: JAIL_ID_COUNT }));
        assert_eq!(
            free_range("alice:100000:65536\n", "alice:100000:65536\nbob:200000:65536\n"),
            Some(Range { start: 265_536, count: JAIL_ID_COUNT })
        );
        assert_eq!(free_range(&format!("x:{}:65536\n", JAIL_ID_BASE - 1000), ""), None, "no room left below root's");
    }

    #[test]
    fn root_maps_the_fixed_base_and_needs_no_range() {
        let root = HostUser {
            uid: 0,
            gid: 0,
            name: Some("root".into()),
            ids: Some((Range { start: JAIL_ID_BASE, count: JAIL_ID_COUNT }, Range { start: JAIL_ID_BASE, count: 1 })),
        };
        assert_eq!(root.jail_problem(), None);
        let unnamed = HostUser { name: None, ..root.clone() };
        assert_eq!(unnamed.display_name(), "root", "looked up when a message needs it");
        let alice = HostUser { uid: 1000, gid: 1000, name: Some("alice".into()), ids: None };
        let problem = alice.jail_problem().expect("no range is a problem");
        assert!(problem.contains("moat setup --user alice") && problem.contains("usermod"), "{problem}");
    }

    /// A user whose uids and gids start apart would own its image's groups
    /// with ids outside its gid range: refused, with the line that mends it.
    #[test]
    fn ranges_that_start_apart_are_refused() {
        let uids = Range { start: 100_000, count: JAIL_ID_COUNT };
        let gids = Range { start: 165_536, count: JAIL_ID_COUNT };
        let alice = HostUser { uid: 1000, gid: 1000, name: Some("alice".into()), ids: Some((uids, gids)) };
        let problem = alice.jail_problem().expect("apart is a problem");
        assert!(
            problem.contains("uids start at 100000 and its gids at 165536")
                && problem.contains("usermod --del-subgids 165536-231071 --add-subgids 100000-165535 alice"),
            "{problem}"
        );
        let together = HostUser { ids: Some((uids, uids)), ..alice };
        assert!(together.jail_problem().is_none_or(|p| p.contains("uidmap")), "{:?}", together.jail_problem());
    }

    #[test]
    fn a_range_is_free_where_no_line_gives_any_of_its_ids() {
        let subid = "alice:100000:65536
bob:300000:65536
broken line
";
        let range = |start| Range { start, count: JAIL_ID_COUNT };
        assert!(is_free(subid, range(165_536)), "between the two");
        assert!(!is_free(subid, range(165_535)), "its first id is alice's last");
        assert!(!is_free(subid, range(250_000)), "its end is bob's");
        assert!(!is_free(subid, range(100_000)), "alice's own");
        assert!(is_free("", range(100_000)));
    }
}
