//! The sandbox's seccomp filter: a classic BPF program that bubblewrap loads (`--seccomp FD`)
//! before it runs the program. It denies, with `EPERM`, what the namespaces and the uid change
//! leave open: creating user namespaces (`unshare` / `clone` with `CLONE_NEWUSER`; `clone3`,
//! whose flags a filter cannot read, answers `ENOSYS` so the C library falls back to `clone`)
//! and the kernel keyrings (`keyctl`, `add_key`, `request_key`: the session keyring of the
//! service would otherwise be readable), and every call of another ABI (i386 through
//! `int 0x80`, x32). Everything else is allowed. x86_64 only; built for another architecture
//! the filter allows everything (the other layers still apply).

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

/// `AUDIT_ARCH_X86_64`.
const ARCH_X86_64: u32 = 0xc000_003e;
const SYS_CLONE: u32 = 56;
const SYS_ADD_KEY: u32 = 248;
const SYS_REQUEST_KEY: u32 = 249;
const SYS_KEYCTL: u32 = 250;
const SYS_UNSHARE: u32 = 272;
const SYS_CLONE3: u32 = 435;
const CLONE_NEWUSER: u32 = 0x1000_0000;
/// Set in the numbers of the x32 ABI's system calls (same architecture value).
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
const RET_ALLOW: u32 = 0x7fff_0000;
/// Calls of another architecture: on x86_64 those are the i386 ones (`int 0x80`), which have
/// their own numbers for `unshare` and `keyctl`: denied. Built elsewhere, the filter checks
/// nothing (its numbers are x86_64's) and allows them.
#[cfg(target_arch = "x86_64")]
const OTHER_ARCH: u32 = RET_ERRNO | EPERM;
#[cfg(not(target_arch = "x86_64"))]
const OTHER_ARCH: u32 = RET_ALLOW;
const RET_ERRNO: u32 = 0x0005_0000;
const EPERM: u32 = 1;
const ENOSYS: u32 = 38;

// Classic BPF opcodes.
const LD_W_ABS: u16 = 0x20;
const JEQ_K: u16 = 0x15;
const JSET_K: u16 = 0x45;
const JGE_K: u16 = 0x35;
const RET_K: u16 = 0x06;

/// Offsets in `struct seccomp_data`: `nr`, `arch`, low word of `args[0]`.
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARG0: u32 = 16;

fn op(code: u16, jt: u8, jf: u8, k: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..2].copy_from_slice(&code.to_le_bytes());
    b[2] = jt;
    b[3] = jf;
    b[4..8].copy_from_slice(&k.to_le_bytes());
    b
}

/// The filter program, as bubblewrap reads it (an array of `struct sock_filter`).
pub fn program() -> Vec<u8> {
    // Jump offsets count instructions after the jump itself.
    let prog = [
        /* 0 */ op(LD_W_ABS, 0, 0, OFF_ARCH),
        /* 1 */ op(JEQ_K, 1, 0, ARCH_X86_64),
        /* 2 */ op(RET_K, 0, 0, OTHER_ARCH),
        /* 3 */ op(LD_W_ABS, 0, 0, OFF_NR),
        /* 4 */ op(JGE_K, 10, 0, X32_SYSCALL_BIT), // x32 calls: denied → 15
        /* 5 */ op(JEQ_K, 6, 0, SYS_UNSHARE), // → 12
        /* 6 */ op(JEQ_K, 5, 0, SYS_CLONE), // → 12
        /* 7 */ op(JEQ_K, 8, 0, SYS_CLONE3), // → 16
        /* 8 */ op(JEQ_K, 6, 0, SYS_KEYCTL), // → 15
        /* 9 */ op(JEQ_K, 5, 0, SYS_ADD_KEY), // → 15
        /* 10 */ op(JEQ_K, 4, 0, SYS_REQUEST_KEY), // → 15
        /* 11 */ op(RET_K, 0, 0, RET_ALLOW),
        /* 12 */ op(LD_W_ABS, 0, 0, OFF_ARG0),
        /* 13 */ op(JSET_K, 1, 0, CLONE_NEWUSER), // → 15
        /* 14 */ op(RET_K, 0, 0, RET_ALLOW),
        /* 15 */ op(RET_K, 0, 0, RET_ERRNO | EPERM),
        /* 16 */ op(RET_K, 0, 0, RET_ERRNO | ENOSYS),
    ];
    prog.concat()
}

/// A file holding [`program`], written once per machine and user: named by its content,
/// created exclusively, and reused only when it is a regular file of this user with exactly
/// that content (a file planted by someone else is not trusted).
pub fn filter_file() -> std::io::Result<PathBuf> {
    let bytes = program();
    let sum = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    });
    // The effective uid: the owner of this process's /proc entry.
    let uid = std::fs::metadata("/proc/self")?.uid();
    let path = std::env::temp_dir().join(format!("rollarc-seccomp-{uid}-{sum:016x}.bpf"));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
    {
        Ok(mut f) => {
            f.write_all(&bytes)?;
            Ok(path)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(&path)?;
            if meta.is_file() && meta.uid() == uid && std::fs::read(&path)? == bytes {
                Ok(path)
            } else {
                Err(std::io::Error::other(format!(
                    "{} exists and is not rollarc's seccomp filter",
                    path.display()
                )))
            }
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_jump_lands_inside_the_program_and_every_path_returns() {
        let p = program();
        assert_eq!(p.len() % 8, 0);
        let n = p.len() / 8;
        let ins: Vec<(u16, u8, u8)> = p
            .chunks(8)
            .map(|c| (u16::from_le_bytes([c[0], c[1]]), c[2], c[3]))
            .collect();
        for (i, (code, jt, jf)) in ins.iter().enumerate() {
            if code & 0x07 == 0x05 {
                // A jump: both targets inside, and forward (classic BPF has no back edges).
                assert!(
                    i + 1 + (*jt as usize) < n && i + 1 + (*jf as usize) < n,
                    "{i}"
                );
            }
        }
        assert_eq!(ins[n - 1].0, RET_K, "the program must end in a return");
        // Both error returns are there, and allow is the default.
        let k =
            |i: usize| u32::from_le_bytes([p[i * 8 + 4], p[i * 8 + 5], p[i * 8 + 6], p[i * 8 + 7]]);
        let rets: Vec<u32> = (0..n).filter(|&i| ins[i].0 == RET_K).map(k).collect();
        assert!(rets.contains(&(RET_ERRNO | EPERM)) && rets.contains(&(RET_ERRNO | ENOSYS)));
        assert!(rets.contains(&RET_ALLOW));
    }

    #[test]
    fn the_filter_file_is_written_once_and_reused() {
        let a = filter_file().unwrap();
        let b = filter_file().unwrap();
        assert_eq!(a, b);
        assert_eq!(std::fs::read(&a).unwrap(), program());
    }
}
