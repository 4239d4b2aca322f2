//! The numeric settings of the environments (see `super::super::knob`).

use super::super::knob::{Knob, KnobInfo, knob};

// Knobs of enum variants: `schema` names the variant as `EnvSpec.<kind>` (its `oneOf` entry).
pub const EXTERNAL_PROTOCOL: Knob<u32> = knob(
    ("EnvSpec.external", "tasks[i].env", "protocol"),
    (1, false, 3),
    Some(1),
    "",
    "Protocol version the program speaks: 1, 2 (dataset rows on reset) or 3 (many episodes per program, an episode id on every message).",
);
/// Most programs one task's multiplexed environment may run.
pub const MAX_ENV_PROCESSES: usize = 256;
/// One knob for the three kinds that run multiplexed programs (`external` with protocol 3,
/// `reasoning_gym`, `gymnasium`); the schema annotates the external one's field.
pub const ENV_PROCESSES: Knob<usize> = knob(
    ("EnvSpec.external", "tasks[i].env", "processes"),
    (1, false, MAX_ENV_PROCESSES),
    Some(1),
    "",
    "Programs serving the task's episodes, each serving many at once (protocol 3: `external` with protocol = 3, and the `reasoning_gym` and `gymnasium` bridges). Raise it for environments whose steps take CPU.",
);

pub const EXTERNAL_MAX_MESSAGE_BYTES: Knob<usize> = knob(
    ("EnvSpec.external", "tasks[i].env", "max_message_bytes"),
    (64, false, 64 << 20),
    Some(actors::env::protocol::MAX_MESSAGE_BYTES),
    "",
    "Longest line (one protocol message) the program may send.",
);
pub const REASONING_GYM_SIZE: Knob<u64> = knob(
    ("EnvSpec.reasoning_gym", "tasks[i].env", "size"),
    (1, false, 10_000_000),
    Some(100_000),
    "",
    "Problems in the generated set; episode seed k serves problem k mod size.",
);

/// The knobs of the environments, in the manual's order.
pub(in crate::spec) fn knobs() -> Vec<KnobInfo> {
    vec![
        EXTERNAL_PROTOCOL.info(),
        EXTERNAL_MAX_MESSAGE_BYTES.info(),
        ENV_PROCESSES.info(),
        REASONING_GYM_SIZE.info(),
    ]
}
