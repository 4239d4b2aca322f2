//! The web dashboard `rollarc serve` answers at `/`: one HTML page, its script and its style
//! sheet, embedded in the binary. The page holds no data of its own; it reads the job API with
//! the token the user gives it (kept in the browser's local storage), so the assets are open
//! and every number behind them stays behind the API's access control.
//!
//! The charts are hand-drawn SVG (`app.js`): the page needs line charts, error bars and a heat
//! map, which take a few hundred lines, where a charting library would be a vendored file of
//! ten times that to keep up to date.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/app.css");

/// The paths the dashboard's assets live at (open: they carry no data).
pub const PATHS: [&str; 3] = ["/", "/ui/app.js", "/ui/app.css"];

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // The page talks to its own origin only; no inline script or style.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
        ),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

pub async fn index() -> Response {
    asset(INDEX, "text/html; charset=utf-8")
}

pub async fn script() -> Response {
    asset(SCRIPT, "text/javascript; charset=utf-8")
}

pub async fn style() -> Response {
    asset(STYLE, "text/css; charset=utf-8")
}
