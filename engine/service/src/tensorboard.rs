//! TensorBoard event files: every step's numbers as scalars, so runs compare side by side in
//! `tensorboard --logdir DATA_DIR/tensorboard` (one directory per job).
//!
//! The format, written here without TensorFlow: a file of TFRecord records (a little-endian
//! u64 length, the masked CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data),
//! each an `Event` protocol buffer; the first holds the file version, the others a step's
//! `Summary` of `(tag, simple_value)` pairs.

use std::io::Write;
use std::path::{Path, PathBuf};

use job::runtime::StepMetrics;

/// Appends events to one file.
pub struct EventWriter {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

impl EventWriter {
    /// A new events file in `dir` (created), named as TensorBoard looks for them, opened with
    /// the file-version event.
    pub fn create(dir: &Path, wall_time_s: f64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!(
            "events.out.tfevents.{}.rollarc.{}",
            wall_time_s as u64,
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let mut w = Self {
            file: std::io::BufWriter::new(file),
            path,
        };
        let mut e = Vec::new();
        double(&mut e, 1, wall_time_s);
        bytes(&mut e, 3, b"brain.Event:2");
        w.record(&e)?;
        w.file.flush()?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One step's scalars (non-finite values are left out).
    pub fn scalars(
        &mut self,
        step: u64,
        wall_time_s: f64,
        values: &[(String, f64)],
    ) -> std::io::Result<()> {
        let mut summary = Vec::new();
        for (tag, v) in values.iter().filter(|(_, v)| v.is_finite()) {
            let mut value = Vec::new();
            bytes(&mut value, 1, tag.as_bytes());
            key(&mut value, 2, 5);
            value.extend_from_slice(&(*v as f32).to_le_bytes());
            bytes(&mut summary, 1, &value);
        }
        let mut e = Vec::new();
        double(&mut e, 1, wall_time_s);
        key(&mut e, 2, 0);
        varint(&mut e, step);
        bytes(&mut e, 5, &summary);
        self.record(&e)?;
        self.file.flush()
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc(&len).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc(data).to_le_bytes())
    }
}

/// The scalars of a step: per task, the rollout, the trainer, held-out evaluations.
pub fn step_scalars(m: &StepMetrics) -> Vec<(String, f64)> {
    let mut v = Vec::new();
    for (task, t) in &m.tasks {
        if t.trajectories == 0 {
            continue;
        }
        v.push((format!("{task}/success"), t.success_rate));
        v.push((format!("{task}/reward"), t.mean_reward));
        v.push((format!("{task}/turns"), t.mean_turns));
        v.push((format!("{task}/truncation_rate"), t.truncation_rate));
    }
    v.extend([
        ("rollout/success".to_string(), m.success_rate),
        ("rollout/reward".into(), m.mean_reward),
        ("rollout/trajectories_per_s".into(), m.trajectories_per_s),
        ("rollout/bubble_ratio".into(), m.bubble_ratio),
        ("rollout/staleness_mean".into(), m.staleness_mean),
        ("rollout/step_s".into(), m.step_s),
        ("rollout/wait_batch_s".into(), m.wait_batch_s),
        ("rollout/rollout_s".into(), m.rollout.rollout_s),
        ("trainer/train_s".into(), m.train_s),
        ("trainer/loss".into(), m.loss),
    ]);
    let n = &m.trainer;
    for (name, x) in [
        ("policy_loss", n.policy_loss),
        ("kl", n.kl),
        ("entropy", n.entropy),
        ("grad_norm", n.grad_norm),
        ("lr", n.lr),
        ("clip_frac_low", n.clip_frac_low),
        ("clip_frac_high", n.clip_frac_high),
        ("is_weight_mean", n.is_weight_mean),
        ("is_weight_max", n.is_weight_max),
        ("response_len_mean", n.response_len_mean),
        ("response_len_max", n.response_len_max.map(|x| x as f64)),
    ] {
        if let Some(x) = x {
            v.push((format!("trainer/{name}"), x));
        }
    }
    v
}

/// A step record's events: its own scalars at its step (counted from 1), and each held-out evaluation
/// it carries at the step it was taken after (0: before training).
pub fn step_events(m: &StepMetrics) -> Vec<(u64, Vec<(String, f64)>)> {
    let mut out = vec![(m.step, step_scalars(m))];
    for e in &m.eval {
        let mut v = Vec::new();
        for (task, t) in &e.tasks {
            v.push((format!("eval/{task}/pass@1"), t.pass_at_1));
            v.push((format!("eval/{task}/pass@{}", t.k), t.pass_at_k));
            v.push((format!("eval/{task}/mean_reward"), t.mean_reward));
        }
        out.push((e.step, v));
    }
    out
}

/// Writes a finished job's steps (as the store kept them) into `dir`: step k at `start_s +
/// elapsed`. Returns the file.
pub fn write_steps(dir: &Path, start_s: f64, steps: &[StepMetrics]) -> std::io::Result<PathBuf> {
    let mut w = EventWriter::create(dir, start_s)?;
    for m in steps {
        for (step, values) in step_events(m) {
            w.scalars(step, start_s + m.elapsed_s, &values)?;
        }
    }
    Ok(w.path().to_path_buf())
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn double(out: &mut Vec<u8>, field: u32, v: f64) {
    key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    key(out, field, 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// CRC-32C (Castagnoli), bit by bit over a table built once.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 == 1 {
                    0x82f6_3b78 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC: rotated right by 15 bits, plus a constant.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C of "123456789" (RFC 3720's check value).
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn records_frame_each_event_with_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), 1_700_000_000.5).unwrap();
        w.scalars(
            3,
            1_700_000_001.0,
            &[("a/b".into(), 0.25), ("nan".into(), f64::NAN)],
        )
        .unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut at = 0;
        let mut records = Vec::new();
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let lc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(lc, masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            let dc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(dc, masked_crc(data));
            records.push(data.to_vec());
            at += 16 + len;
        }
        assert_eq!(records.len(), 2);
        assert!(records[0].ends_with(b"brain.Event:2"));
        // The NaN is left out; the tag and the f32 value are there.
        let r = &records[1];
        assert!(r.windows(3).any(|w| w == b"a/b"));
        assert!(r.windows(4).any(|w| w == 0.25f32.to_le_bytes()));
        assert!(!r.windows(3).any(|w| w == b"nan"));
    }
}

/// A job's TensorBoard run: `job-N`, or `job-N-<name>` for a named job (the name's
/// characters other than letters, digits, `_`, `.` and `-` become one `-` a run; at most 48
/// kept), so
/// runs are told apart by name in TensorBoard's run list.
pub fn run_name(id: &str, name: Option<&str>) -> String {
    let clean: String = name
        .unwrap_or("")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(48)
        .collect();
    // One `-` for each run of replaced characters.
    let mut clean = clean;
    while clean.contains("--") {
        clean = clean.replace("--", "-");
    }
    let clean = clean.trim_matches(['-', '.']);
    if clean.is_empty() {
        id.to_string()
    } else {
        format!("{id}-{clean}")
    }
}

#[cfg(test)]
mod run_name_tests {
    #[test]
    fn runs_are_named_by_job_and_name() {
        use super::run_name;
        assert_eq!(run_name("job-3", None), "job-3");
        assert_eq!(run_name("job-3", Some("lr 1e-5 / α=1")), "job-3-lr-1e-5-1");
        assert_eq!(run_name("job-3", Some("../..")), "job-3");
        assert_eq!(
            run_name("job-3", Some(&"x".repeat(100))).len(),
            "job-3-".len() + 48
        );
    }
}
