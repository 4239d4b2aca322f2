//! Discovery: ready endpoints minus ejected ones, as tower `Change`s.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use tokio::sync::watch;
use tower::discover::Change;

use super::instance::Instance;
use super::outliers::Outliers;
use crate::faas::runtime::Endpoint;

/// Ready endpoints minus ejected ones, as tower `Change`s: re-evaluated whenever the
/// endpoints change, an instance is ejected, or an ejection ends.
pub(super) fn discover(
    mut endpoints: watch::Receiver<Vec<Endpoint>>,
    outliers: Arc<Outliers>,
    make: impl Fn(&Endpoint) -> Instance + Send + 'static,
) -> impl futures::Stream<Item = Result<Change<u64, Instance>, Infallible>> + Send + Unpin + 'static
{
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Change<u64, Instance>, Infallible>>(256);
    tokio::spawn(async move {
        let mut current: BTreeMap<u64, ()> = BTreeMap::new();
        loop {
            let eps = endpoints.borrow_and_update().clone();
            outliers.set_instances(eps.len());
            let (ejected, next_back) = outliers.ejected();
            let want: BTreeMap<u64, &Endpoint> = eps
                .iter()
                .filter(|e| !ejected.contains(&e.id))
                .map(|e| (e.id, e))
                .collect();
            for id in current.keys().copied().collect::<Vec<_>>() {
                if !want.contains_key(&id) {
                    current.remove(&id);
                    if tx.send(Ok(Change::Remove(id))).await.is_err() {
                        return;
                    }
                }
            }
            for (id, ep) in &want {
                if !current.contains_key(id) {
                    current.insert(*id, ());
                    if tx.send(Ok(Change::Insert(*id, make(ep)))).await.is_err() {
                        return;
                    }
                }
            }
            let back = async {
                match next_back {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = endpoints.changed() => if r.is_err() { return },
                _ = outliers.changed.notified() => {}
                _ = back => {}
                _ = tx.closed() => return,
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
