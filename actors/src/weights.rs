//! Versioned policy weights and the weight store actor that shards pull from.

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::types::PolicyVersion;

/// One named tensor, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// A published set of weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    pub version: PolicyVersion,
    /// Real tensors for real backends, copied out as plain rows (small models, external
    /// trainers); empty for simulated ones.
    pub tensors: Vec<Tensor>,
    /// Real tensors shared without a copy (large models in this process): immutable once
    /// published, read by every engine of the job.
    pub shared: Option<SharedTensors>,
    /// Size the transfer is modelled with (bytes), for simulated weight sync.
    pub modelled_bytes: f64,
}

/// Named candle tensors behind one `Arc`; equal when they are the same publication.
#[derive(Clone)]
pub struct SharedTensors(pub Arc<Vec<(String, candle_core::Tensor)>>);

impl PartialEq for SharedTensors {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for SharedTensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedTensors({} tensors)", self.0.len())
    }
}

impl Weights {
    pub fn simulated(version: PolicyVersion, modelled_bytes: f64) -> Self {
        Self {
            version,
            tensors: Vec::new(),
            shared: None,
            modelled_bytes,
        }
    }

    /// Weights of `version` shared as candle tensors (sized by their f32 bytes).
    pub fn from_shared(
        version: PolicyVersion,
        tensors: Vec<(String, candle_core::Tensor)>,
    ) -> Self {
        let bytes: usize = tensors.iter().map(|(_, t)| t.elem_count() * 4).sum();
        Self {
            version,
            tensors: Vec::new(),
            shared: Some(SharedTensors(Arc::new(tensors))),
            modelled_bytes: bytes as f64,
        }
    }

    /// Every real tensor as candle tensors on `dev`, by name: the shared ones as they are,
    /// plain rows converted.
    pub fn candle_tensors(
        &self,
        dev: &candle_core::Device,
    ) -> candle_core::Result<Vec<(String, candle_core::Tensor)>> {
        let mut v: Vec<(String, candle_core::Tensor)> = self
            .shared
            .as_ref()
            .map(|s| s.0.as_ref().clone())
            .unwrap_or_default();
        for t in &self.tensors {
            v.push((
                t.name.clone(),
                candle_core::Tensor::from_slice(&t.data, t.shape.as_slice(), dev)?,
            ));
        }
        Ok(v)
    }
}

pub enum WeightStoreMsg {
    Publish(Arc<Weights>),
    /// The newest finished version.
    Latest(RpcReplyPort<Option<Arc<Weights>>>),
    Get(PolicyVersion, RpcReplyPort<Option<Arc<Weights>>>),
}

/// Keeps the newest `keep` versions (older ones are dropped as new ones are published).
pub struct WeightStore;

pub struct WeightStoreArgs {
    pub keep: usize,
    pub initial: Arc<Weights>,
}

pub struct WeightStoreState {
    keep: usize,
    versions: BTreeMap<PolicyVersion, Arc<Weights>>,
}

impl Actor for WeightStore {
    type Msg = WeightStoreMsg;
    type State = WeightStoreState;
    type Arguments = WeightStoreArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: WeightStoreArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut versions = BTreeMap::new();
        versions.insert(args.initial.version, args.initial);
        Ok(WeightStoreState {
            keep: args.keep.max(1),
            versions,
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WeightStoreMsg::Publish(w) => {
                st.versions.insert(w.version, w);
                while st.versions.len() > st.keep {
                    st.versions.pop_first();
                }
            }
            WeightStoreMsg::Latest(reply) => {
                let _ = reply.send(st.versions.last_key_value().map(|(_, w)| w.clone()));
            }
            WeightStoreMsg::Get(v, reply) => {
                let _ = reply.send(st.versions.get(&v).cloned());
            }
        }
        Ok(())
    }
}
