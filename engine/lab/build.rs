//! Records the commit the binary was built from (`ROLLARC_COMMIT`, "unknown" outside a git
//! checkout) for reports and `--version`.

fn main() {
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=ROLLARC_COMMIT={commit}");
    // Only paths that exist: a missing one would rebuild the crate on every build.
    println!("cargo:rerun-if-changed=build.rs");
    for p in [
        "../../.git/HEAD",
        "../../.git/refs/heads",
        "../../.git/packed-refs",
    ] {
        if std::path::Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}
