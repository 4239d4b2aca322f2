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
/// The trace spans ([`TRACE_TARGET`]) stay out of the log: they are for the OTLP exporter.
pub const DEFAULT_LOG: &str = "info,opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn,opentelemetry_prometheus=warn,rollarc::trace=off";

/// [`DEFAULT_LOG`] with more detail: rollarc's own crates at debug.
pub const DEBUG_LOG: &str = "info,engine=debug,actors=debug,infra=debug,functions=debug,opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn,opentelemetry_prometheus=warn,rollarc::trace=off";

/// The target of the spans a trace is made of: job → step → episode → turn → generate,
/// env.step (and an episode's env.reset and reward). At info level, but enabled only while
/// an OTLP exporter runs, so they cost nothing otherwise (a simulated week has millions).
pub const TRACE_TARGET: &str = "rollarc::trace";

/// What the OTLP span layer takes: the trace spans, and rollarc's info spans and events.
const OTLP_FILTER: &str = "info,opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn,opentelemetry_prometheus=warn,rollarc::trace=info";

/// `ROLLARC_TRACE_EPISODES`: the share of episodes traced (0..=1, default 1). Job and step
/// spans are always kept; an episode is kept or dropped whole, with its turns, by a hash of
/// its id (the same episodes for the same ratio).
pub const TRACE_EPISODES_VAR: &str = "ROLLARC_TRACE_EPISODES";

/// Keeps every span but a share of episodes (and whatever is under a dropped one).
#[derive(Clone, Debug)]
pub struct EpisodeSampler {
    ratio: f64,
}

impl EpisodeSampler {
    pub fn new(ratio: f64) -> Self {
        Self {
            ratio: ratio.clamp(0.0, 1.0),
        }
    }

    /// Whether episode `id` is in the sampled share.
    pub fn keeps(&self, id: u64) -> bool {
        // SplitMix64's finaliser: consecutive ids spread over the whole range.
        let mut z = id.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.ratio
    }
}

impl opentelemetry_sdk::trace::ShouldSample for EpisodeSampler {
    fn should_sample(
        &self,
        parent_context: Option<&opentelemetry::Context>,
        _trace_id: opentelemetry::trace::TraceId,
        name: &str,
        _span_kind: &opentelemetry::trace::SpanKind,
        attributes: &[opentelemetry::KeyValue],
        _links: &[opentelemetry::trace::Link],
    ) -> opentelemetry_sdk::trace::SamplingResult {
        use opentelemetry::trace::TraceContextExt;
        use opentelemetry_sdk::trace::{SamplingDecision, SamplingResult};
        let parent = parent_context.map(|c| c.span().span_context().clone());
        let parent_dropped = parent
            .as_ref()
            .is_some_and(|p| p.is_valid() && !p.is_sampled());
        let keep = !parent_dropped
            && (name != "episode"
                || attributes
                    .iter()
                    .find(|kv| kv.key.as_str() == "episode")
                    .and_then(|kv| match &kv.value {
                        opentelemetry::Value::I64(v) => Some(*v as u64),
                        opentelemetry::Value::String(s) => s.as_str().parse().ok(),
                        _ => None,
                    })
                    .is_none_or(|id| self.keeps(id)));
        SamplingResult {
            decision: if keep {
                SamplingDecision::RecordAndSample
            } else {
                SamplingDecision::Drop
            },
            attributes: Vec::new(),
            trace_state: parent.map(|p| p.trace_state().clone()).unwrap_or_default(),
        }
    }
}
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
                // Room for a burst of turns: the defaults (a 2,048-span queue flushed every
                // 5 s) dropped a quarter of an 8-step job's spans. The OTEL_BSP_* variables
                // still win where set.
                let mut batch = opentelemetry_sdk::trace::BatchConfigBuilder::default();
                if env.var("OTEL_BSP_MAX_QUEUE_SIZE").is_none() {
                    batch = batch.with_max_queue_size(1 << 16);
                }
                if env.var("OTEL_BSP_MAX_EXPORT_BATCH_SIZE").is_none() {
                    batch = batch.with_max_export_batch_size(4096);
                }
                if env.var("OTEL_BSP_SCHEDULE_DELAY").is_none() {
                    batch = batch.with_scheduled_delay(std::time::Duration::from_secs(1));
                }
                let processor = opentelemetry_sdk::trace::BatchSpanProcessor::builder(exp)
                    .with_batch_config(batch.build())
                    .build();
                let ratio = env
                    .var(TRACE_EPISODES_VAR)
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .filter(|r| r.is_finite())
                    .unwrap_or(1.0);
                let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
                    .with_span_processor(processor)
                    .with_sampler(EpisodeSampler::new(ratio))
                    .build();
                let t = opentelemetry::trace::TracerProvider::tracer(&provider, "rollarc");
                tracer = Some(provider);
                // The trace spans and rollarc's info spans (`RUST_LOG` overrides).
                let f =
                    EnvFilter::try_new(env.var("RUST_LOG").unwrap_or_else(|| OTLP_FILTER.into()))
                        .unwrap_or_else(|_| EnvFilter::new(OTLP_FILTER));
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
    let widest = match (&otel, widest == DEBUG_LOG) {
        // The exporter wants the trace spans: let them through the global filter.
        (Some(_), false) => OTLP_FILTER.to_string(),
        (Some(_), true) => DEBUG_LOG.replace("rollarc::trace=off", "rollarc::trace=info"),
        (None, _) => widest.to_string(),
    };
    let global = EnvFilter::try_new(env.var("RUST_LOG").unwrap_or_else(|| widest.clone()))
        .unwrap_or_else(|_| EnvFilter::new(&widest));
    let _ = tracing_subscriber::registry()
        .with(global)
        .with(fmt)
        .with(file)
        .with(otel)
        .try_init();
    TracingGuard { tracer }
}

#[cfg(test)]
mod tests {
    use super::EpisodeSampler;
    use opentelemetry::KeyValue;
    use opentelemetry::trace::{SpanKind, TraceId};
    use opentelemetry_sdk::trace::{SamplingDecision, ShouldSample};

    fn decide(s: &EpisodeSampler, name: &str, attrs: &[KeyValue]) -> SamplingDecision {
        s.should_sample(
            None,
            TraceId::from(1u128),
            name,
            &SpanKind::Internal,
            attrs,
            &[],
        )
        .decision
    }

    #[test]
    fn a_share_of_episodes_is_kept_and_every_other_span() {
        let s = EpisodeSampler::new(0.25);
        let kept = (0..20_000u64).filter(|&i| s.keeps(i)).count() as f64 / 20_000.0;
        assert!((0.23..0.27).contains(&kept), "{kept}");
        // The same episodes every time.
        assert!((0..1000u64).all(|i| s.keeps(i) == EpisodeSampler::new(0.25).keeps(i)));
        let kept_id = (0..100u64).find(|&i| s.keeps(i)).unwrap();
        let dropped_id = (0..100u64).find(|&i| !s.keeps(i)).unwrap();
        assert_eq!(
            decide(&s, "episode", &[KeyValue::new("episode", kept_id as i64)]),
            SamplingDecision::RecordAndSample
        );
        assert_eq!(
            decide(
                &s,
                "episode",
                &[KeyValue::new("episode", dropped_id as i64)]
            ),
            SamplingDecision::Drop
        );
        for name in ["job", "step", "train"] {
            assert_eq!(decide(&s, name, &[]), SamplingDecision::RecordAndSample);
        }
        // Under a dropped episode, its turns go too.
        use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceState};
        let parent = |flags| {
            opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from(1u128),
                SpanId::from(7u64),
                flags,
                false,
                TraceState::default(),
            ))
        };
        let under = |cx: &opentelemetry::Context| {
            s.should_sample(
                Some(cx),
                TraceId::from(1u128),
                "turn",
                &SpanKind::Internal,
                &[],
                &[],
            )
            .decision
        };
        assert_eq!(
            under(&parent(TraceFlags::default())),
            SamplingDecision::Drop
        );
        assert_eq!(
            under(&parent(TraceFlags::SAMPLED)),
            SamplingDecision::RecordAndSample
        );
        assert!((0..1000u64).all(|i| EpisodeSampler::new(1.0).keeps(i)));
        assert!((0..1000u64).all(|i| !EpisodeSampler::new(0.0).keeps(i)));
    }
}
