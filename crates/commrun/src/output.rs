//! Prefixing a rank's output lines with `[rank] `.

use std::io::{self, BufRead, Read};

/// The longest line kept in memory; a longer line is passed on in pieces of this size, each
/// with its own prefix and a newline (so a program printing megabytes without a newline cannot
/// exhaust memory).
pub const MAX_LINE: usize = 1 << 20;

/// The prefix of rank `rank`'s lines: `[rank] `.
pub fn rank_prefix(rank: u32) -> Vec<u8> {
    format!("[{rank}] ").into_bytes()
}

/// Reads `reader` to its end and calls `emit` once per line with `prefix`, the line's bytes and
/// a newline.
///
/// Bytes are passed on as they are (no UTF-8 check). A last line without a newline still gets
/// the prefix and a newline. A line longer than `max_line` bytes is split into pieces. Returns
/// the number of lines emitted; stops early on a read error (other than `Interrupted`).
pub fn prefix_lines<R: BufRead>(
    mut reader: R,
    prefix: &[u8],
    max_line: usize,
    mut emit: impl FnMut(&[u8]),
) -> io::Result<u64> {
    let max_line = max_line.max(1) as u64;
    let mut line = prefix.to_vec();
    let mut count = 0;
    loop {
        line.truncate(prefix.len());
        let n = (&mut reader).take(max_line).read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(count);
        }
        if line.last() != Some(&b'\n') {
            // A piece cut at `max_line` whose newline comes next: take the newline with it
            // rather than emitting an empty line after it.
            if n as u64 == max_line && reader.fill_buf()?.first() == Some(&b'\n') {
                reader.consume(1);
            }
            line.push(b'\n');
        }
        emit(&line);
        count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(input: &[u8], max_line: usize) -> (Vec<u8>, u64) {
        let mut out = Vec::new();
        let n = prefix_lines(input, b"[3] ", max_line, |l| out.extend_from_slice(l)).unwrap();
        (out, n)
    }

    #[test]
    fn whole_lines() {
        assert_eq!(run(b"a\nbb\n\nccc\n", MAX_LINE), (b"[3] a\n[3] bb\n[3] \n[3] ccc\n".to_vec(), 4));
    }

    #[test]
    fn partial_last_line_and_empty_input() {
        assert_eq!(run(b"a\nlast", MAX_LINE), (b"[3] a\n[3] last\n".to_vec(), 2));
        assert_eq!(run(b"", MAX_LINE), (Vec::new(), 0));
    }

    #[test]
    fn non_utf8_bytes_pass_through() {
        assert_eq!(run(b"\xff\xfe\x00x\n\x80", MAX_LINE).0, b"[3] \xff\xfe\x00x\n[3] \x80\n".to_vec());
    }

    #[test]
    fn long_lines_are_split() {
        assert_eq!(run(b"abcdefg\nhi\n", 3).0, b"[3] abc\n[3] def\n[3] g\n[3] hi\n".to_vec());
        assert_eq!(run(b"abc\nabcd", 3).0, b"[3] abc\n[3] abc\n[3] d\n".to_vec());
    }

    #[test]
    fn each_line_is_one_call() {
        let mut calls = Vec::new();
        prefix_lines(&b"x\ny"[..], b"[0] ", MAX_LINE, |l| calls.push(l.to_vec())).unwrap();
        assert_eq!(calls, [b"[0] x\n".to_vec(), b"[0] y\n".to_vec()]);
    }

    #[test]
    fn prefix() {
        assert_eq!(rank_prefix(12), b"[12] ");
    }
}
