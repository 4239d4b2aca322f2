//! Telemetry: a tracing subscriber, an OpenTelemetry meter provider whose readers are a
//! Prometheus registry (served as text on `/metrics`) and, when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, an OTLP exporter for metrics and traces.
//!
//! Metric names follow `rollarc_<subsystem>_<name>_<unit>[_total]`; labels carry only bounded
//! values (pool, task, device, state, code), never ids or messages.

use std::sync::OnceLock;

use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::env::EnvSource;

/// The Prometheus client the registry is made with (job-scoped gauges in the engine use it).
pub use prometheus;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("could not build the prometheus exporter")]
    Prometheus(#[source] opentelemetry_sdk::error::OTelSdkError),
    #[error("could not build the OTLP exporter")]
    Otlp(#[source] opentelemetry_otlp::ExporterBuildError),
    #[error("could not encode metrics")]
    Encode(#[source] prometheus::Error),
}

/// The process-wide metrics pipeline.
pub struct Metrics {
    registry: prometheus::Registry,
    provider: SdkMeterProvider,
}

static METRICS: OnceLock<Metrics> = OnceLock::new();

impl Metrics {
    /// The meter all rollarc instruments come from. Installs the pipeline on first use, so no
    /// instrument is ever created against a no-op provider.
    pub fn global() -> &'static Metrics {
        METRICS.get_or_init(|| {
            Self::build(&crate::env::ProcessEnv).unwrap_or_else(|e| {
                tracing::error!(error = %e, "metrics pipeline failed; serving an empty registry");
                Self {
                    registry: prometheus::Registry::new(),
                    provider: SdkMeterProvider::builder().build(),
                }
            })
        })
    }

    fn build(env: &dyn EnvSource) -> Result<Self, TelemetryError> {
        let registry = prometheus::Registry::new();
        let prom = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_target_info()
            .build()
            .map_err(TelemetryError::Prometheus)?;
        let mut builder = SdkMeterProvider::builder().with_reader(prom);
        if env.var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() {
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .build()
                .map_err(TelemetryError::Otlp)?;
            builder = builder.with_periodic_exporter(exporter);
        }
        let provider = builder.build();
        opentelemetry::global::set_meter_provider(provider.clone());
        Ok(Self { registry, provider })
    }

    pub fn meter(&self) -> Meter {
        self.provider.meter("rollarc")
    }

    /// The Prometheus registry behind `/metrics`: job-scoped gauges (a `job` label, series
    /// removed when the job ends — which OpenTelemetry instruments cannot do) register here.
    pub fn registry(&self) -> &prometheus::Registry {
        &self.registry
    }

    /// Prometheus text exposition of every instrument.
    pub fn render(&self) -> Result<String, TelemetryError> {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .map_err(TelemetryError::Encode)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// Keeps the tracer provider alive; flushes on drop.
pub struct TracingGuard {
    tracer: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        if let Some(t) = self.tracer.take() {
            let _ = t.shutdown();
        }
    }
}

/// The log filter without `RUST_LOG`: rollarc's own info lines; the OpenTelemetry crates'
/// only from warnings up (their info lines, e.g. "Global meter provider is set", used to open
/// every command's output).
pub const DEFAULT_LOG: &str = "info,opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn,opentelemetry_prometheus=warn";

/// [`DEFAULT_LOG`] with more detail: rollarc's own crates at debug.
pub const DEBUG_LOG: &str = "info,engine=debug,actors=debug,infra=debug,functions=debug,opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn,opentelemetry_prometheus=warn";
/// Warnings and errors only (a command's own output is its result).
pub const QUIET_LOG: &str = "warn";

/// Where the log goes: the terminal at one level, and a file (once a command names it with
/// [`log_to_file`]) at another.
#[derive(Clone, Copy, Debug)]
pub struct LogLevels {
    /// On stderr, unless `RUST_LOG` says otherwise.
    pub stderr: &'static str,
    /// In the log file.
    pub file: &'static str,
}

impl Default for LogLevels {
    fn default() -> Self {
        Self {
            stderr: DEFAULT_LOG,
            file: DEFAULT_LOG,
        }
    }
}

/// The log file, once set; lines before that go to stderr only.
static LOG_FILE: std::sync::Mutex<Option<std::fs::File>> = std::sync::Mutex::new(None);

/// Appends every later log line to `path` (its directory is created). The file is the full
/// record of a run whose terminal shows only warnings.
pub fn log_to_file(path: &std::path::Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    *LOG_FILE.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    Ok(())
}

/// Writes to the log file when one is set, else nowhere.
struct FileSink;

impl std::io::Write for FileSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match LOG_FILE.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            Some(f) => f.write_all(buf).map(|()| buf.len()),
            None => Ok(buf.len()),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match LOG_FILE.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            Some(f) => f.flush(),
            None => Ok(()),
        }
    }
}

/// Installs the log subscriber at the default levels (see [`init_tracing_with`]).
pub fn init_tracing(env: &dyn EnvSource) -> TracingGuard {
    init_tracing_with(env, LogLevels::default())
}

/// Installs the log subscriber — stderr at `levels.stderr` (`RUST_LOG` overrides it), the log
/// file at `levels.file` — and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, an OTLP span
/// exporter. Safe to call more than once (the first call wins).
pub fn init_tracing_with(env: &dyn EnvSource, levels: LogLevels) -> TracingGuard {
    use tracing_subscriber::Layer;
    let stderr_filter =
        EnvFilter::try_new(env.var("RUST_LOG").unwrap_or_else(|| levels.stderr.into()))
            .unwrap_or_else(|_| EnvFilter::new(levels.stderr));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .with_filter(stderr_filter);
    let file = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_writer(|| FileSink)
        .with_filter(EnvFilter::new(levels.file));
    let mut tracer = None;
    let otel = if env.var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() {
        match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
        {
            Ok(exp) => {
                let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
                    .with_batch_exporter(exp)
                    .build();
                let t = opentelemetry::trace::TracerProvider::tracer(&provider, "rollarc");
                tracer = Some(provider);
                // Spans at the levels the log would show by default (`RUST_LOG` overrides).
                let f =
                    EnvFilter::try_new(env.var("RUST_LOG").unwrap_or_else(|| DEFAULT_LOG.into()))
                        .unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG));
                Some(tracing_opentelemetry::layer().with_tracer(t).with_filter(f))
            }
            Err(e) => {
                eprintln!("OTLP span exporter disabled: {e}");
                None
            }
        }
    } else {
        None
    };
    // A filter in front of all layers: what no layer wants is disabled where it is written
    // (a span on every turn of a simulated week costs nothing then). Without it, an absent
    // OTLP layer counts as wanting everything and every debug span is built and dropped
    // (measured: the production week's simulation at half speed).
    let rank = |l: &str| {
        [QUIET_LOG, DEFAULT_LOG, DEBUG_LOG]
            .iter()
            .position(|x| *x == l)
    };
    let widest = if rank(levels.file) > rank(levels.stderr) {
        levels.file
    } else {
        levels.stderr
    };
    let global = EnvFilter::try_new(env.var("RUST_LOG").unwrap_or_else(|| widest.into()))
        .unwrap_or_else(|_| EnvFilter::new(widest));
    let _ = tracing_subscriber::registry()
        .with(global)
        .with(fmt)
        .with(file)
        .with(otel)
        .try_init();
    TracingGuard { tracer }
}
