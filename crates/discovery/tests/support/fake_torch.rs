//! A small torch `TCPStore` server for tests, written from torch's `TCPStoreLibUvBackend.cpp`
//! (not from this library's client): the command bytes, `u64`-length strings and vectors,
//! VALIDATE before anything else, WAIT answered with STOP_WAITING (0) once every key exists,
//! CANCEL_WAIT answered with WAIT_CANCELED (1), PING echoing its nonce, GET answering an empty
//! vector for an absent key, COMPARE_SET's "lie" (an absent key with a non-empty `expected`
//! answers `expected`), and the connection closed on a rejected request (a key over 8 KiB, a
//! value over 8 MiB, ADD on a non-integer). One thread per connection, blocking I/O.
#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

const MAGIC: u32 = 0x3C85_F7CE;
const MAX_STRING_LEN: u64 = 8 * 1024;
const MAX_PAYLOAD_LEN: u64 = 8 * 1024 * 1024;

/// A waiting connection: the keys it still awaits, and its writer.
type Waiter = (HashSet<Vec<u8>>, Arc<Mutex<TcpStream>>);

#[derive(Default)]
struct State {
    kv: HashMap<Vec<u8>, Vec<u8>>,
    /// Connection id -> (keys still awaited, its writer).
    waiting: HashMap<u64, Waiter>,
    /// Every command each connection sent, raw, in order.
    log: Vec<(u64, Vec<u8>)>,
    connections: u64,
}

/// The server; stops (closing every connection) when dropped.
pub struct FakeTorchStore {
    port: u16,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    thread: Option<JoinHandle<()>>,
}

impl FakeTorchStore {
    /// Listens on 127.0.0.1 on a free port.
    pub fn start() -> FakeTorchStore {
        Self::start_on("127.0.0.1:0")
    }

    /// Listens on `addr` (`ip:port`).
    pub fn start_on(addr: &str) -> FakeTorchStore {
        let listener = TcpListener::bind(addr).expect("bind the fake torch store");
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let ids = Arc::new(AtomicU64::new(1));
        let (st, sp, cs) = (state.clone(), stop.clone(), conns.clone());
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if sp.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let _ = stream.set_nodelay(true);
                if let Ok(c) = stream.try_clone() {
                    cs.lock().unwrap().push(c);
                }
                st.lock().unwrap().connections += 1;
                let (st, id) = (st.clone(), ids.fetch_add(1, Ordering::SeqCst));
                std::thread::spawn(move || serve(stream, id, st));
            }
        });
        FakeTorchStore { port, state, stop, conns, thread: Some(thread) }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Every command received so far, raw, with its connection id.
    pub fn log(&self) -> Vec<(u64, Vec<u8>)> {
        self.state.lock().unwrap().log.clone()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.lock().unwrap().connections
    }

    /// The stored value of a full (prefixed) key.
    pub fn value(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.state.lock().unwrap().kv.get(key).cloned()
    }

    /// Every stored key (full, prefixed), sorted.
    pub fn keys(&self) -> Vec<Vec<u8>> {
        let mut keys: Vec<_> = self.state.lock().unwrap().kv.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// Sets a full key directly, waking waiters (like another torch client would).
    pub fn put(&self, key: &[u8], value: &[u8]) {
        set(&mut self.state.lock().unwrap(), key, value);
    }
}

impl Drop for FakeTorchStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn set(st: &mut State, key: &[u8], value: &[u8]) {
    st.kv.insert(key.to_vec(), value.to_vec());
    wake(st, key);
}

/// torch's `wakeupWaitingClients`: a waiter whose last awaited key appears gets STOP_WAITING.
fn wake(st: &mut State, key: &[u8]) {
    let mut done = Vec::new();
    for (id, (keys, w)) in st.waiting.iter_mut() {
        if keys.remove(key) && keys.is_empty() {
            let _ = w.lock().unwrap().write_all(&[0]);
            done.push(*id);
        }
    }
    for id in done {
        st.waiting.remove(&id);
    }
}

/// Reads exactly `n` bytes, recording them; `None` when the peer closed.
struct Conn {
    id: u64,
    state: Arc<Mutex<State>>,
    rd: TcpStream,
    wr: Arc<Mutex<TcpStream>>,
    raw: Vec<u8>,
}

impl Conn {
    /// Logs the bytes of the command read so far. Called before any answer goes out, so a
    /// client that has its answer always finds its request in the log.
    fn record(&mut self) {
        if !self.raw.is_empty() {
            let raw = std::mem::take(&mut self.raw);
            self.state.lock().unwrap().log.push((self.id, raw));
        }
    }
    fn bytes(&mut self, n: usize) -> Option<Vec<u8>> {
        let mut b = vec![0; n];
        self.rd.read_exact(&mut b).ok()?;
        self.raw.extend_from_slice(&b);
        Some(b)
    }
    fn u8(&mut self) -> Option<u8> {
        self.bytes(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.bytes(4).map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.bytes(8).map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
    /// A string (key) or a payload, with torch's limits: over them, `None` closes the connection.
    fn vec(&mut self, max: u64) -> Option<Vec<u8>> {
        let n = self.u64()?;
        if n > max {
            return None;
        }
        self.bytes(n as usize)
    }
    fn reply(&mut self, b: &[u8]) -> Option<()> {
        self.record();
        self.wr.lock().unwrap().write_all(b).ok()
    }
}

fn vec_reply(v: &[u8]) -> Vec<u8> {
    [&(v.len() as u64).to_le_bytes()[..], v].concat()
}

fn serve(stream: TcpStream, id: u64, state: Arc<Mutex<State>>) {
    let wr = Arc::new(Mutex::new(stream.try_clone().unwrap()));
    let mut c = Conn { id, state: state.clone(), rd: stream, wr, raw: Vec::new() };
    // Until validated, torch ignores the client (it never answers anything).
    if c.u8() != Some(0) || c.u32() != Some(MAGIC) {
        let mut sink = [0u8; 4096];
        while matches!(c.rd.read(&mut sink), Ok(n) if n > 0) {}
        return;
    }
    c.record();
    while command(&mut c, id, &state).is_some() {
        c.record();
    }
    state.lock().unwrap().waiting.remove(&id);
    let _ = c.rd.shutdown(Shutdown::Both);
}

/// Serves one command; `None` closes the connection.
fn command(c: &mut Conn, id: u64, state: &Mutex<State>) -> Option<()> {
    match c.u8()? {
        // SET
        1 => {
            let (k, v) = (c.vec(MAX_STRING_LEN)?, c.vec(MAX_PAYLOAD_LEN)?);
            set(&mut state.lock().unwrap(), &k, &v);
        }
        // COMPARE_SET
        2 => {
            let (k, expected, desired) = (c.vec(MAX_STRING_LEN)?, c.vec(MAX_PAYLOAD_LEN)?, c.vec(MAX_PAYLOAD_LEN)?);
            let mut st = state.lock().unwrap();
            let now = match st.kv.get(&k).cloned() {
                None if expected.is_empty() => {
                    set(&mut st, &k, &desired);
                    desired
                }
                None => expected,
                Some(cur) if cur == expected => {
                    set(&mut st, &k, &desired);
                    desired
                }
                Some(cur) => cur,
            };
            drop(st);
            c.reply(&vec_reply(&now))?;
        }
        // GET
        3 => {
            let k = c.vec(MAX_STRING_LEN)?;
            let v = state.lock().unwrap().kv.get(&k).cloned().unwrap_or_default();
            c.reply(&vec_reply(&v))?;
        }
        // ADD: std::stoll on the old value; a failure closes the connection.
        4 => {
            let k = c.vec(MAX_STRING_LEN)?;
            let delta = i64::from_le_bytes(c.bytes(8)?.try_into().unwrap());
            let mut st = state.lock().unwrap();
            let old = match st.kv.get(&k) {
                None => 0,
                Some(v) => std::str::from_utf8(v).ok()?.trim().parse::<i64>().ok()?,
            };
            let new = old.wrapping_add(delta);
            set(&mut st, &k, new.to_string().as_bytes());
            drop(st);
            c.reply(&new.to_le_bytes())?;
        }
        // CHECK
        5 => {
            let keys = keys(c)?;
            let st = state.lock().unwrap();
            let ready = keys.iter().all(|k| st.kv.contains_key(k));
            drop(st);
            c.reply(&[if ready { 0 } else { 1 }])?;
        }
        // WAIT
        6 => {
            let keys = keys(c)?;
            // Logged before registering: another connection may answer this wait.
            c.record();
            let mut st = state.lock().unwrap();
            let missing: HashSet<Vec<u8>> = keys.into_iter().filter(|k| !st.kv.contains_key(k)).collect();
            if missing.is_empty() {
                drop(st);
                c.reply(&[0])?;
            } else {
                st.waiting.insert(id, (missing, c.wr.clone()));
            }
        }
        // GETNUMKEYS
        7 => {
            let n = state.lock().unwrap().kv.len() as i64;
            c.reply(&n.to_le_bytes())?;
        }
        // DELETE_KEY
        8 => {
            let k = c.vec(MAX_STRING_LEN)?;
            let n = i64::from(state.lock().unwrap().kv.remove(&k).is_some());
            c.reply(&n.to_le_bytes())?;
        }
        // CANCEL_WAIT
        12 => {
            state.lock().unwrap().waiting.remove(&id);
            c.reply(&[1])?;
        }
        // PING
        13 => {
            let nonce = c.bytes(4)?;
            c.reply(&nonce)?;
        }
        // Unknown: torch closes the connection.
        _ => return None,
    }
    Some(())
}

fn keys(c: &mut Conn) -> Option<Vec<Vec<u8>>> {
    let n = c.u64()?;
    if n > 128 * 1024 {
        return None;
    }
    (0..n).map(|_| c.vec(MAX_STRING_LEN)).collect()
}
