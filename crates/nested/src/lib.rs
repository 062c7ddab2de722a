//! The nested test host: real microVM tests on machines without hardware
//! virtualization.
//!
//! QEMU with TCG and `-cpu max` emulates AMD SVM, so a level-1 Linux inside
//! it can load `kvm-amd` and run microVMs (level 2) with KVM. [`run`] boots
//! level 1 from the image's own kernel, checks that KVM works there, runs a
//! [`Payload`] and returns its exit status and output; [`shell`] opens an
//! interactive level-1 shell. [`level2`] boots the image under QEMU microvm
//! inside level 1: the baseline moat-vmm is measured against.
//!
//! ```no_run
//! let out = moat_nested::run(moat_nested::Payload::new(["moat", "--version"]))?;
//! assert!(out.success());
//! # Ok::<(), moat_nested::Error>(())
//! ```
//!
//! Figures measured here are for ratios taken side by side in one level 1,
//! never for absolute claims: everything runs under TCG emulation.

pub mod bundle;
pub use moat_image::cpio;
mod error;
pub mod level2;
mod machine;
mod payload;

pub use bundle::{Bundle, Sources};
pub use error::{Error, Result, Tails};
pub use payload::{Machine, Output, Payload, Stage, Timeouts};

/// Runs `payload` in a fresh level 1, with the bundle built from
/// [`Sources::from_env`] (and cached).
pub fn run(payload: Payload) -> Result<Output> {
    let bundle = bundle::prepare(&Sources::from_env()?)?;
    run_in(&bundle, &payload)
}

/// Runs `payload` in a fresh level 1 booted from `bundle`.
///
/// Level 1s on one machine run one at a time (a payload waits for the one
/// before it to finish, and its stage timeouts start after the wait): each
/// is a QEMU TCG guest that keeps every host core busy, so two at once on a
/// small host slow each other past their timeouts. `MOAT_NESTED_PARALLEL=1`
/// lifts this on a host with cores to spare.
///
/// When level 1 itself breaks ([`Error::Crashed`]: its kernel crashed or
/// hung, as emulated SVM under TCG now and then makes it: two level 1s in
/// ten that boot microVMs one after another), the payload runs again in a fresh
/// level 1, up to [`ATTEMPTS`] in all, and each failure is printed.
pub fn run_in(bundle: &Bundle, payload: &Payload) -> Result<Output> {
    let _turn = machine::one_at_a_time()?;
    let mut attempt = 1;
    loop {
        match machine::run(bundle, payload) {
            Err(e @ Error::Crashed { .. }) if attempt < ATTEMPTS => {
                eprintln!("moat-nested: {e}\nmoat-nested: running the payload again in a fresh level 1");
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// Runs a payload made of named steps (a test binary's tests, one at a
/// time), at most `per_level` of them in each level 1, resuming where a
/// level 1 broke. `payload` makes the payload for the steps it is given,
/// and that payload writes `done STEP` to `$MOAT_NESTED_MARKS` after each
/// step, passed or not (`failed STEP` before it for a failure).
///
/// Level 1s that boot microVMs one after another break now and then, and
/// the older the more (see docs/testing.md): a fresh level 1 every
/// `per_level` steps keeps them young. When one breaks
/// ([`Error::Crashed`]), the steps it finished are not run again: a fresh
/// level 1 gets the rest. The run gives up only when [`STEP_ATTEMPTS`]
/// level 1s in a row break without finishing a step. A step that failed
/// right before its level 1 broke runs once more in the next one; a step
/// that a level 1 broke on before finishing anything runs second in the
/// next. The output is the
/// last level 1's, with the stdout of every level 1 before it in front,
/// and an exit code that is nonzero when any level 1 had a step fail.
pub fn run_steps(
    bundle: &Bundle,
    steps: &[String],
    per_level: usize,
    mut payload: impl FnMut(&[String]) -> Payload,
) -> Result<Output> {
    let _turn = machine::one_at_a_time()?;
    let mut left: Vec<String> = steps.to_vec();
    let (mut earlier, mut failed) = (Vec::new(), false);
    let mut fruitless = 0;
    let mut rerun: Vec<String> = Vec::new();
    loop {
        let given = &left[..left.len().min(per_level.max(1))];
        let (marks, stdout, result) = match machine::run(bundle, &payload(given)) {
            Ok(mut out) => {
                report_step_times(&out);
                let marks: Vec<String> = out.marks.iter().map(|(_, m)| m.clone()).collect();
                (marks, std::mem::take(&mut out.stdout), Ok(out))
            }
            Err(Error::Crashed { stage, reason, tails }) => {
                let tails = *tails;
                let (marks, stdout) = (tails.marks.clone(), tails.stdout.clone());
                (marks, stdout, Err(Error::Crashed { stage, reason, tails: Box::new(tails) }))
            }
            Err(e) => return Err(e),
        };
        let mut done: Vec<&str> = marks.iter().filter_map(|m| m.strip_prefix("done ")).collect();
        let finished_any = !done.is_empty();
        // A step that failed just before its level 1 broke most likely
        // failed because it was breaking (a test's watchdog ending it while
        // level 1's kernel crawled): it runs again, once, in the next.
        if result.is_err()
            && let Some(last) = done.last().copied()
            && marks.iter().any(|m| m.strip_prefix("failed ") == Some(last))
            && !rerun.iter().any(|r| r == last)
        {
            eprintln!("moat-nested: {last} failed as level 1 broke; it runs again in a fresh level 1");
            rerun.push(last.to_owned());
            done.pop();
        }
        failed |= marks.iter().filter_map(|m| m.strip_prefix("failed ")).any(|f| done.contains(&f));
        let before = left.len();
        left.retain(|step| !done.contains(&step.as_str()));
        earlier.extend_from_slice(&stdout);
        match result {
            // All done; or a payload that did none of the steps it was
            // given, which another level 1 would not do either.
            Ok(mut out) if left.is_empty() || left.len() == before => {
                out.stdout = earlier;
                if (failed || !left.is_empty()) && out.code == 0 {
                    out.code = 1;
                }
                return Ok(out);
            }
            // A level 1 that ended its share of the steps: the next takes more.
            Ok(out) => failed |= out.code != 0,
            Err(e) => {
                fruitless = if left.len() < before { 1 } else { fruitless + 1 };
                if fruitless >= STEP_ATTEMPTS {
                    return Err(e);
                }
                // A step that broke a fresh level 1 before finishing runs
                // second in the next: some break a level 1 only as its
                // first (a fresh level 1's cold caches). A step that
                // finished (failed) and runs again keeps its place.
                if !finished_any && left.len() > 1 {
                    left.swap(0, 1);
                }
                eprintln!(
                    "moat-nested: {e}\nmoat-nested: {} of {} steps done; the other {} run in a fresh level 1",
                    steps.len() - left.len(),
                    steps.len(),
                    left.len()
                );
            }
        }
    }
}

/// Prints how long level 1 took to start the payload and then each step
/// it finished, by the host's clock (level 1's drifts under TCG): where a
/// run of steps spends its minutes, in the log of every run.
fn report_step_times(out: &Output) {
    let started = out.reached(Stage::PayloadStarted).unwrap_or_default();
    eprintln!("moat-nested: {:>6.1} s  level 1 started the payload", started.as_secs_f64());
    let mut since = started;
    for (at, mark) in &out.marks {
        if let Some(step) = mark.strip_prefix("done ") {
            eprintln!("moat-nested: {:>6.1} s  {step}", at.saturating_sub(since).as_secs_f64());
            since = *at;
        }
    }
}

/// How many level 1s in a row may break without finishing a step before a
/// run of steps gives up.
pub const STEP_ATTEMPTS: u32 = 6;

/// Level 1s a payload gets when they break under it (a payload's own
/// failures are never retried).
pub const ATTEMPTS: u32 = 3;

/// A bundle that also carries the running program (a test binary that
/// runs itself in level 1), and that program's name on level 1's `PATH`.
pub fn bundle_with_this_program() -> Result<(Bundle, String)> {
    let exe = std::env::current_exe().map_err(|e| Error::Missing {
        what: "the running program".into(),
        hint: format!("it cannot be found ({e})"),
    })?;
    let name = exe.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut sources = Sources::from_env()?;
    sources.extra.push(exe);
    Ok((bundle::prepare(&sources)?, name))
}

/// An interactive shell in a fresh level 1 on this terminal (the serial
/// console; Ctrl-A X ends QEMU); returns the shell's exit status.
pub fn shell(machine: Machine) -> Result<i32> {
    let bundle = bundle::prepare(&Sources::from_env()?)?;
    shell_in(&bundle, machine)
}

/// [`shell`] in a level 1 booted from `bundle`.
pub fn shell_in(bundle: &Bundle, machine: Machine) -> Result<i32> {
    machine::shell(bundle, machine)
}
