//! Env workers (`rollarc env-worker`) as separate processes on loopback: the worker API over
//! HTTP/2 with its token, slots and refusals; a job whose environments run on three workers
//! while one is SIGKILLed and another drained with SIGTERM.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use actors::env::remote::{Membership, RemoteTask, WorkerPool, WorkerPoolConfig};
use actors::env::{EnvError, Environment};
use tests::rollarc_bin;

/// A worker process; killed when dropped.
pub(crate) struct WorkerProc {
    pub(crate) child: Child,
    pub(crate) url: String,
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        // With the sandboxes under it, even one bubblewrap is still setting up.
        tests::server::kill_tree(self.child.id());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `rollarc env-worker` on a free loopback port with `token` (through the
/// environment, as an operator would set it) and waits for its address.
fn start_worker(slots: usize, token: Option<&str>) -> WorkerProc {
    start_worker_on("127.0.0.1:0", slots, token)
}

/// [`start_worker`] on `listen`.
pub(crate) fn start_worker_on(listen: &str, slots: usize, token: Option<&str>) -> WorkerProc {
    let mut cmd = Command::new(rollarc_bin());
    cmd.args(["env-worker", "--listen", listen, "--slots"])
        .arg(slots.to_string())
        .args(["--drain-timeout-s", "30"])
        .env_remove("ROLLARC_ENV_WORKER_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(t) = token {
        cmd.env("ROLLARC_ENV_WORKER_TOKEN", t);
    }
    let mut child = cmd.spawn().expect("env-worker starts");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("rollarc env-worker listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    WorkerProc { child, url }
}

pub(crate) fn pool(urls: &[&str], token: Option<&str>) -> Arc<WorkerPool> {
    WorkerPool::new(WorkerPoolConfig {
        name: "fleet".into(),
        membership: Membership::Urls(urls.iter().map(|u| u.to_string()).collect()),
        token: token.map(str::to_string),
    })
    .unwrap()
}

pub(crate) fn task(
    pool: &Arc<WorkerPool>,
    key: &str,
    env: serde_json::Value,
    timeout_s: u64,
) -> Arc<RemoteTask> {
    RemoteTask::new(
        Arc::clone(pool),
        key.into(),
        serde_json::json!({ "env": env, "call_timeout_s": timeout_s }),
        Duration::from_secs(timeout_s),
    )
}

#[tokio::test]
async fn a_worker_serves_episodes_over_http2_within_its_slots_and_token() {
    let w = start_worker(2, Some("s3cret"));
    let p = pool(&[&w.url], Some("s3cret"));
    let game = serde_json::json!({"kind": "tictactoe"});
    // A reset waits for a free slot at most its call timeout: 1 s here.
    let t = task(&p, "t1", game.clone(), 1);
    // The remote game plays exactly as the built-in one.
    let mut local = job::envs::builtin(&serde_json::from_value(game).unwrap()).unwrap();
    let mut a = t.env(0);
    assert_eq!(
        a.reset(5).await.unwrap().text,
        local.reset_boxed(5, None).await.unwrap().text
    );
    for cell in ["5", "1", "9"] {
        let (r, l) = (
            a.step(cell, &Default::default()).await.unwrap(),
            local.step_boxed(cell, &Default::default()).await.unwrap(),
        );
        assert_eq!(
            (r.observation.text, r.reward, r.terminated, r.invalid_action),
            (l.observation.text, l.reward, l.terminated, l.invalid_action)
        );
        if r.terminated {
            break;
        }
    }
    // A task a worker cannot host is refused naming the field.
    let sim = task(&p, "t2", serde_json::json!({"kind": "sim"}), 1);
    let e = sim.env(0).reset(1).await.unwrap_err().to_string();
    assert!(e.contains("env.kind") && e.contains("sim"), "{e}");
    // Two slots: a third episode waits for one, then fails naming the pool, the worker and
    // why.
    let (mut b, mut c) = (t.env(1), t.env(2));
    b.reset(6).await.unwrap();
    let e = c.reset(7).await.unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, EnvError::Worker(_)) && msg.contains("env pool fleet") && msg.contains(&w.url),
        "{msg}"
    );
    // Closing an episode frees its slot (the close is sent in the background).
    a.close().await;
    let mut freed = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        p.probe(Duration::from_secs(2)).await;
        if p.snapshot()[0].1.open == 1 {
            freed = true;
            break;
        }
    }
    assert!(freed, "{:?}", p.snapshot());
    let snap = p.snapshot();
    c.reset(7)
        .await
        .unwrap_or_else(|e| panic!("{e}: {snap:?} then {:?}", p.snapshot()));
    // The token: wrong or missing is 401; the health probe needs none.
    let http = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for auth in [Some("Bearer wrong"), None] {
        let mut r = http.get(format!("{}/v1/worker", w.url));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        assert_eq!(r.send().await.unwrap().status(), 401, "{auth:?}");
    }
    let health = reqwest::Client::new()
        .get(format!("{}/healthz", w.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200, "HTTP/1.1 probes work too");
}

#[test]
fn a_worker_without_a_token_refuses_a_public_address() {
    let out = Command::new(rollarc_bin())
        .args(["env-worker", "--listen", "0.0.0.0:0"])
        .env_remove("ROLLARC_ENV_WORKER_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("without a token"),
        "{err}"
    );
}

/// Polls `cond` every 50 ms for at most 30 s.
pub(crate) fn wait_for(rt: &tokio::runtime::Runtime, what: &str, cond: &mut dyn FnMut() -> bool) {
    for _ in 0..600 {
        if cond() {
            return;
        }
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
    }
    panic!("timed out waiting for {what}");
}

/// The worker's state as its API reports it.
pub(crate) async fn worker_state(url: &str, token: &str) -> serde_json::Value {
    reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap()
        .get(format!("{url}/v1/worker"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A version-3 program whose steps take 0.1 s (each request on a thread of its own); an
/// episode ends after two steps with reward 1.
const SLOW: &str = r#"
import json, sys, threading, time
lock = threading.Lock()
steps = {}
def reply(msg):
    with lock:
        sys.stdout.write(json.dumps(msg) + "\n"); sys.stdout.flush()
def handle(req):
    ep, op = req["episode"], req["op"]
    if op == "reset":
        steps[ep] = 0
        return reply({"v": 3, "episode": ep, "ok": True, "observation": "go"})
    if op == "close":
        steps.pop(ep, None)
        return reply({"v": 3, "episode": ep, "ok": True})
    time.sleep(0.1)
    steps[ep] = steps.get(ep, 0) + 1
    done = steps[ep] >= 2
    reply({"v": 3, "episode": ep, "ok": True, "observation": "go", "reward": 1.0 if done else 0.0,
           "terminated": done, "info": {"success": done}})
for line in sys.stdin:
    threading.Thread(target=handle, args=(json.loads(line),)).start()
"#;

/// dnsmasq serving one name from a hosts file the test rewrites; killed when dropped.
pub(crate) struct Dns {
    child: Child,
    hosts: std::path::PathBuf,
    pub(crate) addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) const NAME: &str = "envs.rollarc.test";

impl Dns {
    /// Starts dnsmasq answering `NAME` with `ips` (nothing else, no upstream).
    pub(crate) fn start(ips: &[&str]) -> Dns {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // dnsmasq drops to an unprivileged user: it must still read the file on SIGHUP.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let hosts = dir.path().join("hosts");
        let port = std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let bin = ["/usr/sbin/dnsmasq", "/usr/bin/dnsmasq"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("dnsmasq is installed (make setup)");
        let mut dns = Dns {
            child: Command::new("true").spawn().unwrap(),
            hosts,
            addr: ([127, 0, 0, 1], port).into(),
            _dir: dir,
        };
        dns.set(ips, false);
        dns.child = Command::new(bin)
            .args([
                "--keep-in-foreground",
                "--no-hosts",
                "--no-resolv",
                "--bind-interfaces",
                "--listen-address=127.0.0.1",
                "--local-ttl=0",
                // Authoritative for the test domain: a name it has no address for is
                // NXDOMAIN, not refused.
                "--local=/rollarc.test/",
                "--log-facility=/dev/null",
                "--pid-file=",
            ])
            .arg(format!("--port={port}"))
            .arg(format!("--addn-hosts={}", dns.hosts.display()))
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq starts");
        // On a thread of its own: the caller may be inside a runtime.
        let (addr, want) = (dns.addr, ips.len());
        let ready = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for _ in 0..100 {
                    if infra::dns::lookup(addr, NAME, Duration::from_millis(200))
                        .await
                        .is_ok_and(|a| a.len() == want)
                    {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                false
            })
        })
        .join()
        .unwrap();
        assert!(ready, "dnsmasq answers");
        dns
    }

    /// Makes `NAME` resolve to `ips` (dnsmasq reads the file again on SIGHUP).
    pub(crate) fn set(&self, ips: &[&str], reload: bool) {
        let text: String = ips.iter().map(|ip| format!("{ip} {NAME}\n")).collect();
        std::fs::write(&self.hosts, text).unwrap();
        if reload {
            let hup = Command::new("kill")
                .args(["-HUP", &self.child.id().to_string()])
                .status()
                .unwrap();
            assert!(hup.success());
        }
    }
}

/// A free TCP port on 127.0.0.2 (the workers of the DNS tests listen on 127.0.0.2–5, the
/// same port each: a name resolves to addresses, not ports).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.2:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn a_dns_pool_follows_removals_and_an_open_episode_stays_on_its_worker() {
    let port = free_port();
    let ws: Vec<WorkerProc> = ["127.0.0.2", "127.0.0.3"]
        .iter()
        .map(|ip| start_worker_on(&format!("{ip}:{port}"), 4, None))
        .collect();
    let dns = Dns::start(&["127.0.0.2", "127.0.0.3"]);
    let p = WorkerPool::new(WorkerPoolConfig {
        name: "fleet".into(),
        membership: Membership::Dns {
            host: NAME.into(),
            port,
            nameserver: Some(dns.addr),
            every: Duration::from_millis(500),
        },
        token: None,
    })
    .unwrap();
    let t = task(&p, "t1", serde_json::json!({"kind": "frozenlake"}), 5);
    let mut envs: Vec<_> = (0..4).map(|i| t.env(i)).collect();
    for (i, e) in envs.iter_mut().enumerate() {
        e.reset(i as u64).await.unwrap();
    }
    let urls: Vec<String> = p.snapshot().into_iter().map(|(u, _)| u).collect();
    assert_eq!(urls, [ws[0].url.clone(), ws[1].url.clone()], "both found");
    assert!(
        p.snapshot().iter().all(|(_, st)| st.load() == 2),
        "least loaded first: {:?}",
        p.snapshot()
    );
    // The second worker leaves the name: within a few lookups it is no longer a member, and
    // the episodes open on it go on there.
    dns.set(&["127.0.0.2"], true);
    let mut gone = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if p.snapshot().len() == 1 {
            gone = true;
            break;
        }
    }
    assert!(gone, "{:?}", p.snapshot());
    for e in &mut envs {
        e.step("down", &Default::default()).await.unwrap();
    }
    // A name with no address left: a reset fails at once, naming the pool and the lookup.
    dns.set(&[], true);
    for e in &mut envs {
        e.close().await;
    }
    let mut empty = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if p.snapshot().is_empty() {
            empty = true;
            break;
        }
    }
    assert!(empty, "{:?}", p.snapshot());
    let e = envs[0].reset(9).await.unwrap_err().to_string();
    assert!(
        e.contains("env pool fleet") && e.contains("no workers"),
        "{e}"
    );
}

#[test]
fn a_job_runs_over_dns_discovered_workers_through_a_kill_a_drain_and_a_join() {
    // The job reads the workers' token from the variable its pool names: HOME is set in
    // every test process, so the workers are given its value.
    let token = std::env::var("HOME").unwrap();
    let port = free_port();
    let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"];
    let mut ws: Vec<WorkerProc> = ips[..3]
        .iter()
        .map(|ip| start_worker_on(&format!("{ip}:{port}"), 8, Some(&token)))
        .collect();
    // The pool follows the name's addresses, as it would a headless Service.
    let dns = Dns::start(&ips[..3]);
    let script = SLOW
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    let spec = tests::SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&format!(
            "[[tasks]]\ndomain = \"slow\"\ngroup_size = 4\nmax_turns = 3\nenvs = 12\nenv_pool = \"fleet\"\nenv = {{ kind = \"external\", sandbox = \"none\", protocol = 3, command = [\"python3\", \"-c\", \"{script}\"] }}\n"
        ))
        .rollout("batch_size = 2")
        .rollout("steps = 14")
        .rollout("max_retries_per_group = 8")
        .extra(&format!(
            "[[env_pools]]\nname = \"fleet\"\nworkers = {{ dns = \"{NAME}:{port}\", nameserver = \"{}\", refresh_s = 1 }}\ntoken_env = \"HOME\"",
            dns.addr
        ))
        .extra("[sim]\nclock = \"real\"")
        .build();
    let sink = Arc::new(actors::buffer::MemorySink::default());
    let log = Arc::new(tests::BatchLog::default());
    let job = {
        let (sink, log) = (sink.clone(), log.clone());
        std::thread::spawn(move || job::simrun::run_blocking(spec, 0, 0, sink, log, None))
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let count = || sink.log.lock().unwrap().len();
    let open_on = |w: &WorkerProc| {
        rt.block_on(worker_state(&w.url, &token))["open"]
            .as_u64()
            .unwrap()
    };
    // SIGKILL worker 0 while it holds open episodes.
    wait_for(&rt, "trajectories", &mut || count() >= 8);
    wait_for(&rt, "episodes open on worker 0", &mut || {
        open_on(&ws[0]) > 0
    });
    let killed = ws[0].url.clone();
    // The machine goes, sandboxes and all.
    tests::server::kill_tree(ws[0].child.id());
    let _ = ws[0].child.wait();
    // Drain worker 1 with SIGTERM once the job has gone on; it exits when its episodes end.
    let after_kill = count();
    wait_for(&rt, "progress after the kill", &mut || {
        count() >= after_kill + 8
    });
    wait_for(&rt, "episodes open on worker 1", &mut || {
        open_on(&ws[1]) > 0
    });
    let drained = ws[1].url.clone();
    let term = Command::new("kill")
        .args(["-TERM", &ws[1].child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let mut exited = None;
    wait_for(&rt, "the drained worker to exit", &mut || {
        exited = ws[1].child.try_wait().unwrap();
        exited.is_some()
    });
    // A fourth worker joins the name while the job runs: it gets episodes within 5 s.
    ws.push(start_worker_on(
        &format!("{}:{port}", ips[3]),
        8,
        Some(&token),
    ));
    dns.set(&ips, true);
    let joined = tokio::time::Instant::now();
    let calls_on = |w: &WorkerProc| {
        rt.block_on(worker_state(&w.url, &token))["calls"]
            .as_u64()
            .unwrap()
    };
    wait_for(&rt, "episodes on the fourth worker", &mut || {
        calls_on(&ws[3]) > 0
    });
    let took = joined.elapsed();
    eprintln!("the fourth worker got its first episode {took:?} after it joined the name");
    assert!(
        !job.is_finished(),
        "the job ended before the fourth worker could join"
    );
    let s = job.join().unwrap().expect("the job completes");
    assert_eq!(s.steps_done, 14);
    assert!(
        took < Duration::from_secs(5),
        "the fourth worker got its first episode after {took:?}"
    );
    assert!(exited.unwrap().success(), "the drain ends cleanly");
    let trajectories = sink.log.lock().unwrap();
    let failures: Vec<String> = trajectories
        .iter()
        .filter_map(|t| t.failure.as_ref().map(|f| f.to_string()))
        .collect();
    // Only the kill failed episodes: those it held (a full or draining worker makes a reset
    // wait, it does not fail it).
    let lost = format!("worker {killed} lost the episode");
    assert!(!failures.is_empty(), "the kill failed no episode");
    assert!(
        failures.iter().all(|f| f.contains(&lost)),
        "an episode failed for another reason than the kill of {killed} (drained: {drained}): {failures:?}"
    );
    for (_, b) in log.batches.lock().unwrap().iter() {
        assert!(
            b.trajectories()
                .all(|t| t.failure.is_none() && t.reward == Some(1.0)),
            "a failed episode was trained"
        );
    }
    let last = rt.block_on(worker_state(&ws[2].url, &token));
    assert!(
        last["calls"].as_u64().unwrap() > 0,
        "worker 2 served: {last}"
    );
}
