//! What a project is written in: it decides which package registries a
//! task's `filtered` sandbox may reach.

use serde::{Deserialize, Serialize};

/// What a project is written in, guessed from its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    Python,
    Node,
    Go,
    Rust,
    Shell,
}

impl Runtime {
    /// Every runtime, as tool calls name them.
    pub const ALL: [Self; 5] = [Self::Python, Self::Node, Self::Go, Self::Rust, Self::Shell];

    /// The name tool calls use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Python => "python",
            Self::Node => "node",
            Self::Go => "go",
            Self::Rust => "rust",
            Self::Shell => "shell",
        }
    }

    /// A command that prints the version of the runtime's toolchain on its
    /// first lines (and fails where the image lacks it).
    pub fn version_command(self) -> &'static str {
        match self {
            Self::Python => "python3 --version && pip3 --version | cut -d' ' -f1-2",
            Self::Node => "printf 'node %s\\n' \"$(node --version)\" && printf 'npm %s\\n' \"$(npm --version)\"",
            Self::Go => "go version",
            Self::Rust => "rustc --version && cargo --version",
            Self::Shell => "bash --version | head -n 1",
        }
    }

    /// Guesses from the names of the project's top-level files.
    pub fn detect(names: &[String]) -> Self {
        let has = |n: &str| names.iter().any(|name| name == n);
        if has("Cargo.toml") {
            Self::Rust
        } else if has("go.mod") {
            Self::Go
        } else if has("package.json") {
            Self::Node
        } else if has("pyproject.toml")
            || has("requirements.txt")
            || has("setup.py")
            || names.iter().any(|n| n.ends_with(".py"))
        {
            Self::Python
        } else {
            Self::Shell
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_are_guessed_from_files() {
        let names = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(Runtime::detect(&names(&["Cargo.toml", "src"])), Runtime::Rust);
        assert_eq!(Runtime::detect(&names(&["package.json"])), Runtime::Node);
        assert_eq!(Runtime::detect(&names(&["main.py"])), Runtime::Python);
        assert_eq!(Runtime::detect(&names(&["go.mod"])), Runtime::Go);
        assert_eq!(Runtime::detect(&names(&["run.sh"])), Runtime::Shell);
    }

    #[test]
    fn names_are_the_serialized_ones() {
        for runtime in Runtime::ALL {
            assert_eq!(serde_json::to_value(runtime).expect("serializes"), runtime.as_str());
        }
    }
}
