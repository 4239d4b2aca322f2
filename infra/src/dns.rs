//! A stub resolver for address records: asks one name server for a name's A and AAAA
//! records over UDP (with EDNS0, so answers of up to 4096 bytes fit: a headless Service with
//! a few hundred pods), and again over TCP when the answer comes back truncated. For
//! discovery against a name server that a job names; without one, callers use the system's
//! resolver (`tokio::net::lookup_host`: its search domains, `/etc/hosts`, its cache).
//!
//! Only what an address lookup needs (RFC 1035 messages, RFC 6891's OPT record): no
//! recursion of its own, no cache, no DNSSEC. Every read of a reply is bounds-checked: a
//! malformed reply is an error, never a panic.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;
const TYPE_OPT: u16 = 41;
const CLASS_IN: u16 = 1;
/// The UDP payload size the query advertises (EDNS0).
const UDP_PAYLOAD: u16 = 4096;

/// Why a lookup failed.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("{name:?} is not a domain name: {why}")]
    BadName { name: String, why: &'static str },
    #[error("the name server {server} did not answer within {timeout:?}")]
    Timeout {
        server: SocketAddr,
        timeout: Duration,
    },
    #[error("asking the name server {server}")]
    Io {
        server: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the name server {server} sent a malformed reply: {why}")]
    Malformed {
        server: SocketAddr,
        why: &'static str,
    },
    #[error("the name server {server} answered with error code {rcode}")]
    Refused { server: SocketAddr, rcode: u8 },
}

/// The IPv4 and IPv6 addresses of `name` according to `server` (none when the name does not
/// exist), each record type asked within `timeout`; an error only when both questions fail.
pub async fn lookup(
    server: SocketAddr,
    name: &str,
    timeout: Duration,
) -> Result<Vec<IpAddr>, DnsError> {
    // A server may refuse one record type it does not serve (dnsmasq without an upstream
    // refuses AAAA for a name it has only IPv4 addresses for): one answer is enough.
    let (v4, v6) = (
        ask(server, name, TYPE_A, timeout).await,
        ask(server, name, TYPE_AAAA, timeout).await,
    );
    let mut out = match (v4, v6) {
        (Ok(a), Ok(b)) => [a, b].concat(),
        (Ok(a), Err(_)) | (Err(_), Ok(a)) => a,
        (Err(e), Err(_)) => return Err(e),
    };
    out.sort();
    out.dedup();
    Ok(out)
}

async fn ask(
    server: SocketAddr,
    name: &str,
    qtype: u16,
    timeout: Duration,
) -> Result<Vec<IpAddr>, DnsError> {
    let id = query_id();
    let query = encode_query(id, name, qtype)?;
    let io = |source| DnsError::Io { server, source };
    let over_udp = async {
        let local: SocketAddr = if server.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let sock = tokio::net::UdpSocket::bind(local).await.map_err(io)?;
        sock.connect(server).await.map_err(io)?;
        sock.send(&query).await.map_err(io)?;
        let mut buf = vec![0u8; usize::from(UDP_PAYLOAD)];
        loop {
            let n = sock.recv(&mut buf).await.map_err(io)?;
            // A stray datagram (an old query's late answer) is not ours: wait on.
            if n >= 2 && u16::from_be_bytes([buf[0], buf[1]]) == id {
                break Ok::<_, DnsError>(buf[..n].to_vec());
            }
        }
    };
    let reply = tokio::time::timeout(timeout, over_udp)
        .await
        .map_err(|_| DnsError::Timeout { server, timeout })??;
    match parse_reply(&reply, id, qtype).map_err(|why| DnsError::Malformed { server, why })? {
        Reply::Truncated => {}
        Reply::Rcode(rcode) => return Err(DnsError::Refused { server, rcode }),
        Reply::Addresses(a) => return Ok(a),
    }
    // Truncated: the whole answer over TCP (a two-byte length before each message).
    let over_tcp = async {
        let mut s = tokio::net::TcpStream::connect(server).await.map_err(io)?;
        let mut framed = (query.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&query);
        s.write_all(&framed).await.map_err(io)?;
        let len = s.read_u16().await.map_err(io)?;
        let mut buf = vec![0u8; usize::from(len)];
        s.read_exact(&mut buf).await.map_err(io)?;
        Ok::<_, DnsError>(buf)
    };
    let reply = tokio::time::timeout(timeout, over_tcp)
        .await
        .map_err(|_| DnsError::Timeout { server, timeout })??;
    match parse_reply(&reply, id, qtype).map_err(|why| DnsError::Malformed { server, why })? {
        Reply::Addresses(a) => Ok(a),
        Reply::Rcode(rcode) => Err(DnsError::Refused { server, rcode }),
        Reply::Truncated => Err(DnsError::Malformed {
            server,
            why: "truncated over TCP",
        }),
    }
}

/// A query id the server must echo (random: a stray or forged reply rarely matches;
/// without system randomness, a counter: the reply is still checked against it).
fn query_id() -> u16 {
    use ring::rand::SecureRandom;
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);
    let mut b = [0u8; 2];
    match ring::rand::SystemRandom::new().fill(&mut b) {
        Ok(()) => u16::from_be_bytes(b),
        Err(_) => NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    }
}

/// A recursive query for `name`'s records of `qtype`, with an OPT record offering
/// [`UDP_PAYLOAD`] bytes.
fn encode_query(id: u16, name: &str, qtype: u16) -> Result<Vec<u8>, DnsError> {
    let bad = |why| DnsError::BadName {
        name: name.to_string(),
        why,
    };
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    if trimmed.is_empty() || trimmed.len() > 253 {
        return Err(bad("1 to 253 characters"));
    }
    let mut q = Vec::with_capacity(32 + trimmed.len());
    q.extend_from_slice(&id.to_be_bytes());
    // Flags: a standard query, recursion desired. One question, one additional (OPT).
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 1]);
    for label in trimmed.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(bad("each label 1 to 63 characters"));
        }
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&CLASS_IN.to_be_bytes());
    // OPT: root name, type 41, class = payload size, TTL 0 (no flags), no data.
    q.push(0);
    q.extend_from_slice(&TYPE_OPT.to_be_bytes());
    q.extend_from_slice(&UDP_PAYLOAD.to_be_bytes());
    q.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    Ok(q)
}

#[derive(Debug, PartialEq)]
enum Reply {
    Addresses(Vec<IpAddr>),
    Truncated,
    Rcode(u8),
}

/// Reads a reply to query `id`: its addresses of `qtype` (none for a name that does not
/// exist), or that it was truncated, or its error code.
fn parse_reply(m: &[u8], id: u16, qtype: u16) -> Result<Reply, &'static str> {
    let u16_at = |i: usize| -> Result<u16, &'static str> {
        m.get(i..i + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or("cut short")
    };
    if u16_at(0)? != id {
        return Err("another query's id");
    }
    let flags = u16_at(2)?;
    if flags & 0x8000 == 0 {
        return Err("not a reply");
    }
    if flags & 0x0200 != 0 {
        return Ok(Reply::Truncated);
    }
    match (flags & 0x000f) as u8 {
        0 => {}
        // NXDOMAIN: the name has no records at all.
        3 => return Ok(Reply::Addresses(Vec::new())),
        rcode => return Ok(Reply::Rcode(rcode)),
    }
    let (questions, answers) = (u16_at(4)?, u16_at(6)?);
    let mut i = 12;
    for _ in 0..questions {
        i = skip_name(m, i)? + 4;
    }
    let mut out = Vec::new();
    for _ in 0..answers {
        i = skip_name(m, i)?;
        let (rtype, len) = (u16_at(i)?, usize::from(u16_at(i + 8)?));
        let data = m.get(i + 10..i + 10 + len).ok_or("cut short")?;
        match (rtype, len) {
            (TYPE_A, 4) if rtype == qtype => {
                out.push(IpAddr::V4(Ipv4Addr::new(
                    data[0], data[1], data[2], data[3],
                )));
            }
            (TYPE_AAAA, 16) if rtype == qtype => {
                let mut b = [0u8; 16];
                b.copy_from_slice(data);
                out.push(IpAddr::V6(Ipv6Addr::from(b)));
            }
            // A CNAME on the way, or a record of another type: not an address.
            _ => {}
        }
        i += 10 + len;
    }
    Ok(Reply::Addresses(out))
}

/// The offset after the name at `i` (labels, ending in a zero or a compression pointer).
fn skip_name(m: &[u8], mut i: usize) -> Result<usize, &'static str> {
    for _ in 0..128 {
        let len = *m.get(i).ok_or("cut short")?;
        match len & 0xc0 {
            0x00 if len == 0 => return Ok(i + 1),
            0x00 => i += 1 + usize::from(len),
            0xc0 => return m.get(i + 1).map(|_| i + 2).ok_or("cut short"),
            _ => return Err("a label type this resolver does not know"),
        }
    }
    Err("a name of more than 128 labels")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply to query 7 for `a.b`: the question, then a CNAME and two A records whose names
    /// point back at the question (compression), as a server writes them.
    fn reply(flags: u16, answers: &[(u16, &[u8])]) -> Vec<u8> {
        let mut m = 7u16.to_be_bytes().to_vec();
        m.extend_from_slice(&flags.to_be_bytes());
        m.extend_from_slice(&[0, 1, 0, answers.len() as u8, 0, 0, 0, 0]);
        m.extend_from_slice(&[1, b'a', 1, b'b', 0, 0, 1, 0, 1]);
        for (t, data) in answers {
            m.extend_from_slice(&[0xc0, 12]);
            m.extend_from_slice(&t.to_be_bytes());
            m.extend_from_slice(&[0, 1, 0, 0, 0, 30]);
            m.extend_from_slice(&(data.len() as u16).to_be_bytes());
            m.extend_from_slice(data);
        }
        m
    }

    #[test]
    fn replies_are_read_and_malformed_ones_refused() {
        let cname: &[u8] = &[1, b'c', 0];
        let m = reply(
            0x8180,
            &[
                (5, cname),
                (TYPE_A, &[10, 0, 0, 7]),
                (TYPE_A, &[10, 0, 0, 8]),
            ],
        );
        assert_eq!(
            parse_reply(&m, 7, TYPE_A),
            Ok(Reply::Addresses(vec![
                "10.0.0.7".parse().unwrap(),
                "10.0.0.8".parse().unwrap()
            ]))
        );
        assert_eq!(parse_reply(&m, 8, TYPE_A), Err("another query's id"));
        // Every cut of the message is an error or a shorter reading, never a panic.
        for n in 0..m.len() {
            let _ = parse_reply(&m[..n], 7, TYPE_A);
        }
        assert_eq!(
            parse_reply(&reply(0x8183, &[]), 7, TYPE_A),
            Ok(Reply::Addresses(vec![])),
            "NXDOMAIN: no address"
        );
        assert_eq!(
            parse_reply(&reply(0x8182, &[]), 7, TYPE_A),
            Ok(Reply::Rcode(2))
        );
        assert_eq!(
            parse_reply(&reply(0x8380, &[]), 7, TYPE_A),
            Ok(Reply::Truncated)
        );
        let q = encode_query(7, "envs.ns.svc.", TYPE_AAAA).unwrap();
        assert_eq!(&q[12..25], b"\x04envs\x02ns\x03svc\x00");
        assert!(encode_query(7, "a..b", TYPE_A).is_err());
        assert!(encode_query(7, &"x".repeat(64), TYPE_A).is_err());
    }
}
