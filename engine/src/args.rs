//! The command line of `rollarc`: its global options and subcommands (clap).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rollarc", version = lab::VERSION, about = "Rollout engine for agentic RL")]
pub(crate) struct Cli {
    /// Address of a running service (client commands).
    #[arg(
        long,
        global = true,
        visible_alias = "service",
        env = "ROLLARC_SERVER",
        default_value = "http://127.0.0.1:8080"
    )]
    pub(crate) server: String,
    /// Bearer token of the client commands (a service with `[access]` tokens needs one).
    #[arg(long, global = true, env = "ROLLARC_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// More log on the terminal: `-v` info, `-vv` debug (`RUST_LOG` overrides). Commands
    /// show warnings only by default; `serve` logs at info. `run` and `serve` also keep the
    /// whole log (info, or debug with `-vv`) in DATA_DIR/logs/rollarc.log.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub(crate) verbose: u8,
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Run the service.
    Serve {
        /// HOST:PORT to listen on (overrides the config file).
        #[arg(long)]
        addr: Option<String>,
        /// Directory of the store (overrides the config file).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Service config (TOML: addr, data_dir, max_running, grace_s, max_memory_gib,
        /// insecure_public,
        /// [access] tokens / metrics / rate_limit, [policy] executables / allow_unsandboxed).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen on a non-loopback address even without access tokens.
        #[arg(long)]
        insecure_public: bool,
    },
    /// Print a new API token and the `[[access.tokens]]` entry (its SHA-256) for the service
    /// config. The token is shown once; the config keeps only its digest.
    Token {
        #[arg(long)]
        name: String,
        /// read, submit or admin.
        #[arg(long, default_value = "submit")]
        role: String,
    },
    /// Submit a job spec (TOML or JSON) to a running service.
    Submit {
        file: PathBuf,
        /// Change one field of the file: PATH=VALUE, e.g. `--set rollout.steps=20 --set
        /// tasks[0].group_size=4` (VALUE read as TOML, else as a string); `~PATH` removes a
        /// field, e.g. `--set '~trainer.aggregation'`.
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
    },
    /// Show one job, or list all, as a table (`--json`: the raw records).
    Status {
        id: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Follow a job's progress.
    Watch { id: String },
    /// Cancel a job.
    Cancel { id: String },
    /// Train a job with `trainer = { kind = "external" }` as an external process: the
    /// built-in trainer, speaking only the trainer API (lease a batch, step, export the weights
    /// as safetensors under --out, announce them, acknowledge). Resumes from its checkpoint.
    Train {
        /// The job to train.
        #[arg(long)]
        job: String,
        /// The trainer's directory (checkpoints in trainer/, exported weights in weights/); the
        /// service reads the weights from here: a shared path outside its data directory.
        #[arg(long)]
        out: PathBuf,
        /// The built-in trainer's settings: a job spec whose [trainer] is kind = "builtin"
        /// (e.g. examples/quickstart.toml), or a file with that table alone. Default: the
        /// built-in trainer's defaults.
        #[arg(long)]
        trainer: Option<PathBuf>,
        /// The base checkpoint, when the service's path to it is not this machine's.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Seconds one batch request waits (at most 60).
        #[arg(long, default_value_t = 30.0)]
        wait_s: f64,
    },
    /// Run a job with the service in-process: submit, watch, summary; exit code 0 on success.
    Run {
        file: PathBuf,
        /// Change one field of the file: PATH=VALUE, e.g. `--set rollout.steps=20 --set
        /// tasks[0].group_size=4` (VALUE read as TOML, else as a string); `~PATH` removes a
        /// field, e.g. `--set '~trainer.aggregation'`.
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        /// Where the end-of-run report (`summary.json`) goes.
        #[arg(long, default_value = "report")]
        report: PathBuf,
    },
    /// Write the report (summary.json, plots) of a job kept in a data directory.
    Report {
        job: String,
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        #[arg(long, default_value = "report")]
        out: PathBuf,
    },
    /// Derive a simulation spec from a finished real job's telemetry (measured engine-step,
    /// training and environment costs), for `rollarc sim` to predict it at other settings.
    Profile {
        job: String,
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        /// Where the simulation spec (JSON) goes.
        #[arg(long, default_value = "profiled.json")]
        out: PathBuf,
    },
    /// Export the policy a checkpoint job trained (its newest checkpoint, or `--version`) as
    /// a GGUF file or a Hugging Face directory, for inference servers.
    Export {
        job: String,
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        #[arg(long)]
        version: Option<u64>,
        /// gguf (f32), gguf-q8 (q8_0 matrices) or hf.
        #[arg(long, default_value = "gguf")]
        format: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Run a fully simulated job in virtual time and print its figures.
    Sim {
        file: PathBuf,
        /// Change one field of the file: PATH=VALUE, e.g. `--set rollout.steps=20 --set
        /// tasks[0].group_size=4` (VALUE read as TOML, else as a string); `~PATH` removes a
        /// field, e.g. `--set '~trainer.aggregation'`.
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        /// Override the spec's preset.
        #[arg(long)]
        preset: Option<String>,
        /// Run under several presets and print the ratios against the first.
        #[arg(long, value_delimiter = ',')]
        compare: Vec<String>,
    },
    /// Run a scenario file (experiments on the simulated cluster) and check it against the paper.
    Scenario {
        file: PathBuf,
        /// Write the results as JSON here.
        #[arg(long)]
        json_out: Option<PathBuf>,
        /// Only the table (no line per run).
        #[arg(long)]
        quiet: bool,
    },
    /// Run every scenario (default: examples/sim/*.toml), print the table against the paper,
    /// write summary.json and plots.
    BenchSim {
        files: Vec<PathBuf>,
        #[arg(long, default_value = "report/sim")]
        out: PathBuf,
        /// Scenario processes at once.
        #[arg(long, default_value_t = 2)]
        parallel: usize,
    },
    /// Capacity planner: search trainer size and rollout hardware mix under a cost budget
    /// (H20 = 1), then α, environment slots, sandbox cores and reward replicas, with the
    /// simulator; rank by cost per step and recommend the cheapest. FILE is a scenario (its
    /// `[plan]` table) or a job spec (a `rollarc profile` of a real run; `--search` gives the
    /// table).
    Plan {
        scenario: PathBuf,
        /// GPU budget (H20 = 1); without it the spec's GPUs stay as they are.
        #[arg(long)]
        budget: Option<f64>,
        /// A TOML file with the `[plan]` table, for a job spec (a scenario has its own).
        #[arg(long)]
        search: Option<PathBuf>,
        /// Write the candidates as JSON here.
        #[arg(long)]
        json_out: Option<PathBuf>,
        /// Write the recommended configuration's job spec (JSON) here.
        #[arg(long)]
        spec_out: Option<PathBuf>,
    },
    /// Serve a built-in environment over the environment protocol on stdin/stdout, e.g.
    /// `rollarc env-serve '{"kind":"frozenlake","size":4}'`.
    EnvServe { spec: String },
    /// Host environment sandboxes for services on other machines: a job's `[[env_pools]]`
    /// names this worker's URL, registers its tasks here and runs their episodes over HTTP/2
    /// (see docs/environments.md). Drains on SIGTERM.
    EnvWorker(EnvWorkerArgs),
    /// List GPUs with the profile the mapper would use.
    Devices,
    /// Benchmarks: scheduler overhead (zero-latency simulated backends) and the built-in model.
    Bench {
        #[arg(long, default_value_t = 10_000)]
        episodes: usize,
        /// scheduler, model, llm, llm-train, servers, env, env-workers, functions, presets, presets-llm (not in all), batches, gateway or all.
        #[arg(long, default_value = "all")]
        what: String,
        /// Training steps per run of the preset benchmark.
        #[arg(long, default_value_t = 12)]
        preset_steps: u64,
        /// `presets-llm`: the seeds each preset runs with (one run each).
        #[arg(long, value_delimiter = ',', default_values_t = [1u64, 2, 3])]
        seeds: Vec<u64>,
        /// `presets-llm`: the held-out pass@1 each run is timed to.
        #[arg(long, default_value_t = 0.8)]
        goal: f64,
        /// `presets-llm`: the most training steps of a run.
        #[arg(long, default_value_t = 30)]
        max_steps: u64,
    },
}

/// `rollarc env-worker`'s options.
#[derive(clap::Args)]
pub(crate) struct EnvWorkerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub(crate) listen: String,
    /// Episodes open at once over all tasks.
    #[arg(long, default_value_t = 64)]
    pub(crate) slots: usize,
    /// A file holding the shared bearer token (else `ROLLARC_ENV_WORKER_TOKEN`).
    #[arg(long)]
    pub(crate) token_file: Option<PathBuf>,
    /// Serve a non-loopback address without a token (anyone who reaches it can run
    /// programs).
    #[arg(long)]
    pub(crate) allow_no_token: bool,
    /// How long running episodes may go on after SIGTERM before they are stopped.
    #[arg(long, default_value_t = 300.0)]
    pub(crate) drain_timeout_s: f64,
    /// Where the bridges' scripts are written (default: the temporary directory).
    #[arg(long)]
    pub(crate) scratch_dir: Option<PathBuf>,
    /// Environment programs starting at once over all tasks, from spawn to first answer
    /// (default: no cap).
    #[arg(long)]
    pub(crate) max_concurrent_starts: Option<usize>,
    /// Programs each task keeps started ahead, unless its job's pool says (protocols 1
    /// and 2).
    #[arg(long, default_value_t = 0)]
    pub(crate) warm: usize,
}
