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
    /// Real tensors for real backends; empty for simulated ones.
    pub tensors: Vec<Tensor>,
    /// Size the transfer is modelled with (bytes), for simulated weight sync.
    pub modelled_bytes: f64,
}

impl Weights {
    pub fn simulated(version: PolicyVersion, modelled_bytes: f64) -> Self {
        Self {
            version,
            tensors: Vec::new(),
            modelled_bytes,
        }
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
