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

/// Installs the log subscriber (`RUST_LOG`, default [`DEFAULT_LOG`]) and, when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set, an OTLP span exporter. Safe to call more than once.
pub fn init_tracing(env: &dyn EnvSource) -> TracingGuard {
    let filter = EnvFilter::try_new(env.var("RUST_LOG").unwrap_or_else(|| DEFAULT_LOG.into()))
        .unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
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
                Some(tracing_opentelemetry::layer().with_tracer(t))
            }
            Err(e) => {
                eprintln!("OTLP span exporter disabled: {e}");
                None
            }
        }
    } else {
        None
    };
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
    TracingGuard { tracer }
}
