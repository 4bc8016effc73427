//! [`Reply`]: what a simulated server answers, written in RESP2 as Redis writes it; and the
//! reading of a client's commands (arrays of bulk strings) from the bytes it sent.

/// One answer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Reply {
    Status(String),
    Error(String),
    Integer(i64),
    Bulk(Vec<u8>),
    Nil,
    Array(Vec<Reply>),
}

impl Reply {
    pub(crate) fn ok() -> Reply {
        Reply::Status("OK".into())
    }

    /// Appends the reply in RESP2.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Status(s) => {
                out.push(b'+');
                out.extend_from_slice(s.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            Reply::Error(s) => {
                out.push(b'-');
                out.extend_from_slice(s.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            Reply::Integer(n) => {
                out.extend_from_slice(format!(":{n}\r\n").as_bytes());
            }
            Reply::Bulk(b) => {
                out.extend_from_slice(format!("${}\r\n", b.len()).as_bytes());
                out.extend_from_slice(b);
                out.extend_from_slice(b"\r\n");
            }
            Reply::Nil => out.extend_from_slice(b"$-1\r\n"),
            Reply::Array(items) => {
                out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
                for item in items {
                    item.write(out);
                }
            }
        }
    }

    /// Whether it is an error answer.
    pub(crate) fn is_error(&self) -> bool {
        matches!(self, Reply::Error(_))
    }
}

/// A command that does not parse: the connection is closed, as Redis closes it on a protocol
/// error.
#[derive(Debug)]
pub(crate) struct Malformed;

/// A command's arguments, and the bytes it took.
pub(crate) type Command = (Vec<Vec<u8>>, usize);

/// The first whole command in `buf` and the bytes it took, `Ok(None)` when more are needed.
pub(crate) fn command(buf: &[u8]) -> Result<Option<Command>, Malformed> {
    fn line(buf: &[u8], from: usize) -> Option<(&[u8], usize)> {
        let end = buf[from..].windows(2).position(|w| w == b"\r\n")?;
        Some((&buf[from..from + end], from + end + 2))
    }
    fn count(text: &[u8]) -> Result<usize, Malformed> {
        std::str::from_utf8(text)
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or(Malformed)
    }
    if buf.is_empty() {
        return Ok(None);
    }
    if buf[0] != b'*' {
        return Err(Malformed);
    }
    let Some((head, mut at)) = line(buf, 1) else {
        return Ok(None);
    };
    let n = count(head)?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        if at >= buf.len() {
            return Ok(None);
        }
        if buf[at] != b'$' {
            return Err(Malformed);
        }
        let Some((len, start)) = line(buf, at + 1) else {
            return Ok(None);
        };
        let len = count(len)?;
        if buf.len() < start + len + 2 {
            return Ok(None);
        }
        if &buf[start + len..start + len + 2] != b"\r\n" {
            return Err(Malformed);
        }
        args.push(buf[start..start + len].to_vec());
        at = start + len + 2;
    }
    Ok(Some((args, at)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_read_whole_or_not_at_all() {
        let bytes = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*1\r\n$4\r\nPING\r\n";
        let (args, used) = command(bytes).unwrap().unwrap();
        assert_eq!(args, [b"GET".to_vec(), b"k".to_vec()]);
        let (args, rest) = command(&bytes[used..]).unwrap().unwrap();
        assert_eq!(args, [b"PING".to_vec()]);
        assert_eq!(used + rest, bytes.len());
        for cut in 1..used {
            assert!(command(&bytes[..cut]).unwrap().is_none(), "cut at {cut}");
        }
        assert!(command(b"PING\r\n").is_err());
    }
}
