//! The thread every child is forked from (see [`super::spawn`]): the parent-death signal a
//! child asks for fires when the thread that forked it exits, so that thread must live as
//! long as the process.

use std::io;
use std::sync::OnceLock;
use std::sync::mpsc::{Sender, SyncSender, sync_channel};

use tokio::process::{Child, Command};

struct Request {
    cmd: Command,
    /// The caller's runtime: the child's pipes and exit are registered with it.
    runtime: Option<tokio::runtime::Handle>,
    reply: SyncSender<io::Result<Child>>,
}

fn thread() -> Option<&'static Sender<Request>> {
    static THREAD: OnceLock<Option<Sender<Request>>> = OnceLock::new();
    THREAD
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<Request>();
            std::thread::Builder::new()
                .name("rollarc-spawner".into())
                .spawn(move || {
                    for mut r in rx {
                        let _entered = r.runtime.as_ref().map(|h| h.enter());
                        let _ = r.reply.send(r.cmd.spawn());
                    }
                })
                .ok()
                .map(|_| tx)
        })
        .as_ref()
}

/// Forks `cmd` on the spawner thread (on the calling thread if that cannot start).
pub(super) fn spawn(mut cmd: Command) -> io::Result<Child> {
    let Some(t) = thread() else {
        return cmd.spawn();
    };
    let (reply, answer) = sync_channel(1);
    let runtime = tokio::runtime::Handle::try_current().ok();
    if let Err(mut back) = t.send(Request {
        cmd,
        runtime,
        reply,
    }) {
        return back.0.cmd.spawn();
    }
    answer
        .recv()
        .unwrap_or_else(|_| Err(io::Error::other("the spawner thread is gone")))
}
