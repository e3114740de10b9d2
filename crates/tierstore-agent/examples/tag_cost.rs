//! What the frame tags and `[cluster] encrypt` cost a peer transfer, paired in one process: the owner
//! sends a file over a real TCP connection on loopback, and the reader takes it as the read path does
//! (each frame through its seal, each chunk received into a buffer and hashed with blake3, one credit per
//! chunk). Plain frames (what every TCP frame was before the tags) and tagged ones go out through the
//! owner's `sendfile` path (`tierstore_agent::sendfile::send_chunks`); encrypted ones through the
//! buffered path an encrypting agent takes (each chunk read into memory and encrypted). The three modes
//! alternate round by round. Reports the CPU seconds per GB of both ends together (`getrusage` of the
//! process) and the wall time, per mode, and their ratios to plain.
//!
//! Usage: cargo run --release -p tierstore-agent --example tag_cost -- [MiB per round] [rounds]
//! (bench/bench_tags.py runs it and writes docs/benchmarks/tags.md).

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use tierstore_agent::protocol::{Frame, Head, Seals};
use tierstore_agent::sendfile::{send_chunks, Polled};

/// The chunks an owner may send ahead of the reader, as a reader's first request grants.
const CREDIT: u32 = 4;

fn cpu_seconds() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the buffer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr()) };
    // SAFETY: initialised by getrusage (or zeroed).
    let u = unsafe { u.assume_init() };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(u.ru_utime) + s(u.ru_stime)
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    Tagged,
    Encrypted,
}

/// The buffered send of an encrypting owner: each chunk read into memory, encrypted, written; credit
/// read between chunks.
fn send_encrypted(mut s: TcpStream, mut seals: Seals, file: &std::fs::File, size: u64) {
    use std::os::unix::fs::FileExt;
    let (mut offset, mut credit) = (0u64, CREDIT);
    while offset < size {
        while credit == 0 {
            match seals.recv.read_frame(&mut s).unwrap() {
                Some(Frame::Credit { more, .. }) => credit += more,
                other => panic!("{other:?}"),
            }
        }
        let n = (1u64 << 20).min(size - offset) as usize;
        let mut data = vec![0u8; n];
        file.read_exact_at(&mut data, offset).unwrap();
        seals.send.write_frame(&mut s, &Frame::Chunk { id: 1, offset, data }).unwrap();
        (offset, credit) = (offset + n as u64, credit - 1);
    }
}

/// One transfer of `file` (`size` bytes) in `mode`; returns (wall seconds, CPU seconds).
fn transfer(file: &std::fs::File, size: u64, mode: Mode) -> (f64, f64) {
    let (mut owner, mut reader) = match mode {
        Mode::Plain => (Seals::default(), Seals::default()),
        _ => (Seals::keyed([1; 32], [2; 32]), Seals::keyed([2; 32], [1; 32])),
    };
    if mode == Mode::Encrypted {
        owner.encrypt(b"an agreed secret");
        reader.encrypt(b"an agreed secret");
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut r = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let (t, cpu) = (Instant::now(), cpu_seconds());
    let f = file.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        if mode == Mode::Encrypted {
            return send_encrypted(s, owner, &f, size);
        }
        s.set_nonblocking(true).unwrap();
        let to = Polled::new(OwnedFd::from(s), owner, Duration::from_secs(10));
        send_chunks(to, &f, size, 1, CREDIT, None).unwrap().0.unwrap();
    });
    let mut hasher = blake3::Hasher::new();
    let (mut got, mut buf) = (0u64, vec![0u8; 1 << 20]);
    let (chunks, mut granted) = (size.div_ceil(1 << 20), CREDIT as u64);
    while got < size {
        match reader.recv.read_head(&mut r).unwrap().unwrap() {
            Head::Chunk { len, .. } => {
                reader.recv.take_data(&mut r, &mut buf[..len]).unwrap();
                hasher.update(&buf[..len]);
                got += len as u64;
                // No more credit than chunks left: the owner closes once it sent the last one.
                if granted < chunks {
                    reader.send.write_frame(&mut r, &Frame::Credit { id: 1, more: 1 }).unwrap();
                    granted += 1;
                }
            }
            other => panic!("{other:?}"),
        }
    }
    sender.join().unwrap();
    std::hint::black_box(hasher.finalize());
    (t.elapsed().as_secs_f64(), cpu_seconds() - cpu)
}

/// The CPU seconds the tags of one GB's transfer take on both ends, timed alone: every chunk header and
/// every credit frame sealed by its sender and checked by its receiver (the fastest of 20 runs).
fn tag_seconds_per_gb() -> f64 {
    use tierstore_agent::protocol::Seal;
    let chunks = (1e9 / (1u64 << 20) as f64).ceil() as u64;
    let mut best = f64::MAX;
    for _ in 0..20 {
        let (mut a, mut b) = (Seal::keyed([1; 32]), Seal::keyed([1; 32]));
        let (mut c, mut d) = (Seal::keyed([2; 32]), Seal::keyed([2; 32]));
        let t = Instant::now();
        for k in 0..chunks {
            let head = a.chunk_head(1, k << 20, 1 << 20);
            let mut head = head;
            let (prefix, body) = head.split_at_mut(4 + tierstore_agent::protocol::TAG);
            b.check(prefix, body).unwrap();
            let mut credit = c.bytes_of(&Frame::Credit { id: 1, more: 1 });
            let (prefix, body) = credit.split_at_mut(4 + tierstore_agent::protocol::TAG);
            d.check(prefix, body).unwrap();
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let (mib, rounds) = (args.first().copied().unwrap_or(1024), args.get(1).copied().unwrap_or(7));
    let size = mib << 20;
    let mut file = tempfile::tempfile_in("/dev/shm").or_else(|_| tempfile::tempfile()).unwrap();
    let block: Vec<u8> = (0..1 << 20).map(|i| (i * 31 % 251) as u8).collect();
    for _ in 0..mib {
        file.write_all(&block).unwrap();
    }
    transfer(&file, size, Mode::Plain);
    let gb = size as f64 / 1e9;
    let (mut plain, mut tagged, mut encrypted) = (Vec::new(), Vec::new(), Vec::new());
    let modes = [Mode::Plain, Mode::Tagged, Mode::Encrypted];
    for round in 0..rounds as usize {
        // Each round starts with another mode, so that none always runs first.
        for k in 0..3 {
            let mode = modes[(round + k) % 3];
            let (wall, cpu) = transfer(&file, size, mode);
            let into = match mode {
                Mode::Plain => &mut plain,
                Mode::Tagged => &mut tagged,
                Mode::Encrypted => &mut encrypted,
            };
            into.push((wall, cpu / gb));
        }
    }
    let ratios: Vec<f64> = plain.iter().zip(&tagged).map(|(p, t)| t.1 / p.1).collect();
    let wall_ratios: Vec<f64> = plain.iter().zip(&tagged).map(|(p, t)| t.0 / p.0).collect();
    let enc_ratios: Vec<f64> = plain.iter().zip(&encrypted).map(|(p, e)| e.1 / p.1).collect();
    let out = serde_json::json!({
        "mib": mib,
        "rounds": rounds,
        "plain_cpu_s_per_gb": median(plain.iter().map(|p| p.1).collect()),
        "tagged_cpu_s_per_gb": median(tagged.iter().map(|p| p.1).collect()),
        "plain_gbit_s": median(plain.iter().map(|p| gb * 8.0 / p.0).collect()),
        "tagged_gbit_s": median(tagged.iter().map(|p| gb * 8.0 / p.0).collect()),
        "cpu_ratio_median": median(ratios.clone()),
        "cpu_ratios": ratios,
        "wall_ratio_median": median(wall_ratios),
        "encrypted_cpu_s_per_gb": median(encrypted.iter().map(|p| p.1).collect()),
        "encrypted_gbit_s": median(encrypted.iter().map(|p| gb * 8.0 / p.0).collect()),
        "encrypted_cpu_ratio_median": median(enc_ratios.clone()),
        "encrypted_cpu_ratios": enc_ratios,
        "frames_per_gb": (1e9 / (1u64 << 20) as f64 * 2.0).round(),
        "tag_cpu_s_per_gb": tag_seconds_per_gb(),
    });
    println!("{out}");
}
