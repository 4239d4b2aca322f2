//! The trainer API's core: a step's batch as an external trainer receives it
//! ([`TrainingBatch`]), the desk that offers batches durably (in the store, from assembly to
//! acknowledgement) and leases them, and the trainer ([`ExternalTrainer`]) that hands each
//! step's batch to the desk and waits for its acknowledgement.
//!
//! Files by part: `batch` is the batch's wire form, `desk` the desk, `served` what announced
//! weights are checked against, `external` the trainer.

mod batch;
mod desk;
mod external;
mod served;

pub use batch::{BatchGroup, Sample, TrainingBatch};
pub use desk::BatchDesk;
pub use external::ExternalTrainer;
pub use served::{AnnouncedError, ServedModel, file_sha256, reader_sha256};
