//! What every plot shares: the font PNG text is drawn with, and the error of a plot that could
//! not be drawn.

use std::path::{Path, PathBuf};

use plotters::drawing::DrawingAreaErrorKind;

/// A drawing backend's error, kept as the cause of a [`PlotError`].
pub type DrawError = Box<dyn std::error::Error + Send + Sync>;

/// A plot that could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot create {}", dir.display())]
    Dir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot draw {}", file.display())]
    Draw {
        file: PathBuf,
        #[source]
        source: DrawError,
    },
}

impl PlotError {
    /// `file` could not be drawn: the backend said why.
    pub fn draw<E>(file: &Path, source: DrawingAreaErrorKind<E>) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::Draw {
            file: file.to_path_buf(),
            source: Box::new(source),
        }
    }
}

/// The font PNG text is drawn with (DejaVu Sans, shipped in `assets/fonts` with its licence;
/// SVG text needs no font).
static FONT: &[u8] = include_bytes!("../../../../assets/fonts/DejaVuSans.ttf");

pub(crate) fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, FONT)
            .is_err()
        {
            tracing::warn!("the shipped font could not be loaded; PNG plots will have no text");
        }
    });
}
