//! The tool advice in the errors a model sees. Core says what went wrong in
//! its own words, for every caller; a model also needs to know which tool
//! puts it right, and that is added here, where a core error becomes a
//! tool's error.

use moat_core::{CoreError, SandboxError};

/// For each kind of core error: core's words, and the words a model is
/// shown instead, which name the tool.
fn phrases(error: &CoreError) -> &'static [(&'static str, &'static str)] {
    match error {
        CoreError::Sandbox(SandboxError::Unresponsive { .. }) => {
            &[("Destroy it and create another", "Destroy it (destroy_sandbox) and create another")]
        }
        CoreError::Sandbox(SandboxError::CodeSession { .. }) => {
            &[("destroy the sandbox and create another", "destroy the sandbox (destroy_sandbox) and create another")]
        }
        _ => &[],
    }
}

/// `message` (the text of `error` and its causes) with the tools that put
/// `error` right named.
pub(crate) fn advise(error: &CoreError, message: String) -> String {
    phrases(error).iter().fold(message, |text, (core, tool)| text.replacen(core, tool, 1))
}

#[cfg(test)]
mod tests {
    use moat_core::CreateError;

    use moat_core::TaskError;

    use super::*;

    fn shown(error: impl Into<CoreError>) -> String {
        crate::tools::ToolError::from(error.into()).0
    }

    #[test]
    fn an_unknown_id_names_no_other_sessions_sandboxes_or_tasks() {
        let known = vec!["sbx-theirs".to_owned(), "task-theirs".to_owned()];
        for error in [
            CoreError::from(SandboxError::UnknownSandbox { id: "sbx-mine".into(), known: known.clone() }),
            TaskError::Sandbox(SandboxError::UnknownSandbox { id: "sbx-mine".into(), known: known.clone() }).into(),
            TaskError::UnknownTask { id: "task-mine".into(), known }.into(),
        ] {
            let text = crate::tools::ToolError::from(error).0;
            assert!(text.contains("-mine") && !text.contains("theirs"), "{text}");
        }
    }

    #[test]
    fn an_unresponsive_sandbox_is_destroyed_with_destroy_sandbox() {
        let text = shown(SandboxError::Unresponsive { id: "sbx-1".into(), waited_s: 35 });
        assert_eq!(
            text,
            "Sandbox sbx-1 did not answer for 35 s (a command gets 30 s past its own timeout, any other call 300 s): \
             its agent or kernel is stuck. Destroy it (destroy_sandbox) and create another"
        );
    }

    #[test]
    fn a_task_whose_sandbox_is_unresponsive_names_destroy_sandbox() {
        let text = shown(TaskError::Sandbox(SandboxError::Unresponsive { id: "sbx-1".into(), waited_s: 35 }));
        assert!(text.ends_with("Destroy it (destroy_sandbox) and create another"), "{text}");
    }

    #[test]
    fn a_python_session_that_never_starts_names_destroy_sandbox() {
        let reason = "python3 was not ready within 31 s; the sandbox is overloaded or stuck. Run the code again, or \
                      destroy the sandbox and create another if it does not answer";
        let text = shown(SandboxError::CodeSession { id: "sbx-1".into(), reason: reason.into() });
        assert!(text.contains("destroy the sandbox (destroy_sandbox) and create another"), "{text}");
    }

    #[test]
    fn other_errors_are_shown_as_core_says_them() {
        let error = CreateError::LimitReached { max: 2 };
        let core = error.to_string();
        assert_eq!(shown(error), core);
    }
}
