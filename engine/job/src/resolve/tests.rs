use std::collections::HashMap;
use std::path::Path;

use infra::env::MapEnv;

use super::*;
use crate::spec::{Format, parse};

fn spec_with(task: &str, pools: &str) -> String {
    format!("[[tasks]]\ndomain = \"t\"\n{task}\n{pools}")
}

const SIM_POOL: &str = "[[pools]]\nname = \"p\"\ndevice = \"H20\"\nbackend = { kind = \"sim\" }\n";

fn host<'a>(vars: &'a MapEnv, cwd: &Path, scratch: &Path) -> Host<'a> {
    Host {
        vars,
        cwd: Some(cwd.to_path_buf()),
        scratch: scratch.to_path_buf(),
    }
}

#[test]
fn validation_reads_no_file_and_accept_checks_what_the_spec_names() {
    let missing_rows = spec_with(
        "dataset = { path = \"/no/such/rows.jsonl\" }\n[tasks.env]\nkind = \"prompt\"",
        SIM_POOL,
    );
    let missing_checkpoint = format!(
        "{}\n[trainer]\nkind = \"builtin\"\n",
        spec_with(
            "[tasks.env]\nkind = \"arithmetic\"",
            "[[pools]]\nname = \"p\"\ndevice = \"CPU\"\nbackend = { kind = \"builtin\", model = { path = \"/no/such/model.gguf\" } }\n",
        )
    );
    for (text, field) in [
        (&missing_rows, "tasks[0].dataset.path"),
        (&missing_checkpoint, "pools[0].backend.model.path"),
    ] {
        // Validation alone is a pure function of the text: it never looks for the file.
        let spec = parse(text, Format::Toml).expect("valid without reading any file");
        let errs = check(&spec);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].field, field);
        let refused = accept(text, Format::Toml).expect_err(field).0;
        assert_eq!(refused, errs);
        // Resolving at start fails on the same field, with the source kept.
        let e = resolve(&spec, &Host::process()).expect_err(field);
        assert!(
            e.to_string().starts_with(field.trim_end_matches(".path")),
            "{e}"
        );
        assert!(std::error::Error::source(&e).is_some(), "{e:?}");
    }
}

#[test]
fn resolve_reads_only_the_host_it_is_handed() {
    let dir = tempfile::tempdir().unwrap();
    let (cwd, scratch) = (dir.path().join("cwd"), dir.path().join("scratch"));
    std::fs::create_dir_all(cwd.join("envs")).unwrap();
    std::fs::write(cwd.join("envs/game.py"), "print()\n").unwrap();
    let text = spec_with(
        "[tasks.env]\nkind = \"external\"\ncommand = [\"python3\", \"envs/game.py\", \"--missing\", \"nothing/here\"]\nsandbox = \"none\"",
        SIM_POOL,
    );
    let spec = parse(&text, Format::Toml).unwrap();
    let vars = MapEnv(HashMap::from([("HOME".to_string(), "/home/u".to_string())]));
    let r = resolve(&spec, &host(&vars, &cwd, &scratch)).unwrap();
    let program = r.tasks[0].program.as_ref().expect("an external program");
    // Only an argument that names an existing path under the working directory changes.
    assert_eq!(
        program.command,
        [
            "python3".to_string(),
            cwd.join("envs/game.py").to_string_lossy().into_owned(),
            "--missing".into(),
            "nothing/here".into(),
        ]
    );
    assert_eq!(program.sandbox, EnvSandbox::None);
    assert_eq!(
        r.xllamacpp_python,
        "/home/u/.cache/rollarc/xllamacpp-venv/bin/python"
    );
    let vars = MapEnv(HashMap::from([(
        "ROLLARC_XLLAMACPP_PYTHON".to_string(),
        "/opt/py/bin/python".to_string(),
    )]));
    assert_eq!(xllamacpp_python(&vars), "/opt/py/bin/python");
    // A bridged environment's script is written under the scratch directory given.
    let text = spec_with(
        "[tasks.env]\nkind = \"reasoning_gym\"\ndataset = \"chain_sum\"\nsandbox = \"none\"",
        SIM_POOL,
    );
    let spec = parse(&text, Format::Toml).unwrap();
    let r = resolve(&spec, &host(&vars, &cwd, &scratch)).unwrap();
    let program = r.tasks[0].program.as_ref().expect("a bridge program");
    let script = Path::new(&program.command[1]);
    assert!(script.starts_with(&scratch), "{script:?}");
    assert!(
        std::fs::read_to_string(script)
            .unwrap()
            .contains("reasoning_gym")
    );
}

#[test]
fn the_plan_refuses_inputs_that_were_not_resolved() {
    let text = spec_with(
        "[tasks.env]\nkind = \"external\"\ncommand = [\"game\"]\nsandbox = \"none\"",
        SIM_POOL,
    );
    let spec = parse(&text, Format::Toml).unwrap();
    let e = crate::wiring::plan(&spec, &Resolved::default())
        .err()
        .expect("no inputs");
    assert!(
        matches!(e, crate::wiring::WiringError::Unresolved { task: 0 }),
        "{e}"
    );
    let r = resolve(&spec, &Host::process()).unwrap();
    assert!(crate::wiring::plan(&spec, &r).is_ok());
}
