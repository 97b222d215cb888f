//! Parsing of `--sizes`: `8B..64MiB`, `8B..64MiB:x8`, `1KiB..1MiB:+256KiB`, `8B,1KiB,1MiB`.

/// One size, as every `COMM_*` size variable reads it (`8B`, `4KiB`, `64M`).
pub(crate) use comm_core::config::parse_size;

/// Parses a whole `--sizes` value into the list of requested sizes, in order.
///
/// Items are separated by commas; each is a single size or a range `LO..HI` with an optional
/// step: `:xF` multiplies by `F` (default `:x2`), `:+S` adds `S` bytes. `HI` is included
/// when the steps land on it.
pub(crate) fn parse_sizes(spec: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((lo, rest)) = item.split_once("..") else {
            out.push(parse_size(item)?);
            continue;
        };
        let (hi, step) = match rest.split_once(':') {
            Some((hi, step)) => (hi, Some(step.trim())),
            None => (rest, None),
        };
        let (lo, hi) = (parse_size(lo)?, parse_size(hi)?);
        if lo == 0 {
            return Err(format!("`{item}`: a range must start above 0 bytes"));
        }
        if hi < lo {
            return Err(format!("`{item}`: the range ends below its start"));
        }
        let next: Box<dyn Fn(usize) -> Option<usize>> = match step {
            None => Box::new(|s: usize| s.checked_mul(2)),
            Some(st) if st.starts_with(['x', 'X', '*']) => {
                let f: usize = st[1..]
                    .trim()
                    .parse()
                    .map_err(|_| format!("`{item}`: bad step factor `{st}` (expected e.g. x2)"))?;
                if f < 2 {
                    return Err(format!("`{item}`: the step factor must be at least 2"));
                }
                Box::new(move |s: usize| s.checked_mul(f))
            }
            Some(st) if st.starts_with('+') => {
                let inc = parse_size(&st[1..])?;
                if inc == 0 {
                    return Err(format!("`{item}`: the step increment must be above 0"));
                }
                Box::new(move |s: usize| s.checked_add(inc))
            }
            Some(st) => return Err(format!("`{item}`: bad step `{st}` (expected :xF or :+SIZE)")),
        };
        let mut s = lo;
        loop {
            out.push(s);
            match next(s) {
                Some(n) if n <= hi => s = n,
                _ => break,
            }
        }
    }
    if out.is_empty() {
        return Err("no sizes given".into());
    }
    Ok(out)
}

/// Formats a byte count the way `--sizes` accepts it (`64MiB`, `8B`, `1536B`).
pub(crate) fn format_size(bytes: usize) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_sizes_and_units() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("8B").unwrap(), 8);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("2M").unwrap(), 2 << 20);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size(" 3 MB ").unwrap(), 3 << 20);
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("3 parsecs").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn ranges() {
        let v = parse_sizes("8B..64MiB").unwrap();
        assert_eq!(v.len(), 24);
        assert_eq!((v[0], v[23]), (8, 64 << 20));
        assert_eq!(parse_sizes("8B..1MiB:x16").unwrap(), [8, 128, 2048, 32768, 524288]);
        assert_eq!(parse_sizes("1K..3K:+1K").unwrap(), [1024, 2048, 3072]);
        assert_eq!(parse_sizes("8B,1KiB,1MiB").unwrap(), [8, 1024, 1 << 20]);
        assert_eq!(parse_sizes("4..4").unwrap(), [4]);
        assert_eq!(parse_sizes("8B..100B").unwrap(), [8, 16, 32, 64]);
        assert!(parse_sizes("1MiB..8B").is_err());
        assert!(parse_sizes("8B..1MiB:x1").is_err());
        assert!(parse_sizes("8B..1MiB:y3").is_err());
        assert!(parse_sizes("0..8").is_err());
        assert!(parse_sizes("").is_err());
    }

    #[test]
    fn formatting_round_trips() {
        for s in [8, 1536, 1024, 64 << 20, 3 << 30] {
            assert_eq!(parse_size(&format_size(s)).unwrap(), s);
        }
        assert_eq!(format_size(64 << 20), "64MiB");
    }
}
