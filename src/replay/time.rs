//! Timestamps of recorded traffic: decimal seconds, RFC 3339 and the access log's date, read
//! exactly to the microsecond from their text (a JSON number from its shortest decimal form).

use std::time::Duration;

use crate::clock::{MONTHS, unix_seconds};

/// Decimal seconds (`1733223600`, `1733223600.125`, `12.5`) or an RFC 3339 timestamp
/// (`2026-12-03T10:00:00.125Z`, `2026-12-03 10:00:00+01:00`).
pub(super) fn parse_time(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("the time is empty".to_owned());
    }
    if text.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return parse_seconds(text);
    }
    parse_rfc3339(text)
}

/// The last second RFC 3339 can write (9999-12-31T23:59:59Z): larger "seconds" are most
/// likely milliseconds.
const MAX_SECONDS: u64 = 253_402_300_799;

/// `seconds[.fraction]`, at most six fractional digits.
fn parse_seconds(text: &str) -> Result<Duration, String> {
    let bad = || format!("the time `{text}` is not seconds (digits, at most six after a `.`)");
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty()
        || fraction.len() > 6
        || fraction.contains('.')
        || (text.contains('.') && fraction.is_empty())
    {
        return Err(bad());
    }
    let seconds: u64 = whole.parse().map_err(|_| bad())?;
    if seconds > MAX_SECONDS {
        return Err(format!(
            "the time `{text}` is after the year 9999 as seconds: milliseconds? (times are seconds)"
        ));
    }
    let micros = if fraction.is_empty() {
        0
    } else {
        let digits: u64 = fraction.parse().map_err(|_| bad())?;
        digits * 10u64.pow(6 - fraction.len() as u32)
    };
    Ok(Duration::from_secs(seconds) + Duration::from_micros(micros))
}

/// `YYYY-MM-DD(T| )hh:mm:ss[.frac](Z|±hh:mm)`.
fn parse_rfc3339(text: &str) -> Result<Duration, String> {
    let bad = || {
        format!("the time `{text}` is neither seconds nor RFC 3339 (like 2026-12-03T10:00:00.125Z)")
    };
    let b = text.as_bytes();
    // Every slice below is at a byte position: ASCII only.
    if !text.is_ascii()
        || b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
    {
        return Err(bad());
    }
    let year = number(&text[0..4]).ok_or_else(bad)?;
    let month = number(&text[5..7]).ok_or_else(bad)?;
    let day = number(&text[8..10]).ok_or_else(bad)?;
    let (clock, offset) = split_offset(&text[11..]).ok_or_else(bad)?;
    let (hms, fraction) = clock.split_once('.').unwrap_or((clock, ""));
    let hms = hms.as_bytes();
    if hms.len() != 8 || hms[2] != b':' || hms[5] != b':' {
        return Err(bad());
    }
    let hour = number(&clock[0..2]).ok_or_else(bad)?;
    let minute = number(&clock[3..5]).ok_or_else(bad)?;
    let second = number(&clock[6..8]).ok_or_else(bad)?;
    let micros = fraction_micros(fraction).ok_or_else(bad)?;
    let local = unix_seconds(year, month, day, hour, minute, second).ok_or_else(bad)?;
    let utc = to_utc(local, offset).ok_or_else(bad)?;
    Ok(Duration::from_secs(utc) + Duration::from_micros(micros))
}

/// The access log's `10/Oct/2026:13:55:36 -0700` (the text between its brackets).
pub(super) fn parse_log_date(text: &str) -> Result<Duration, String> {
    let bad = || format!("the date `{text}` is not like 10/Oct/2026:13:55:36 +0000");
    // Every slice below is at a byte position: ASCII only.
    if !text.is_ascii() {
        return Err(bad());
    }
    let (clock, zone) = text.split_once(' ').ok_or_else(bad)?;
    let b = clock.as_bytes();
    if b.len() < 20
        || b[2] != b'/'
        || b[6] != b'/'
        || b[11] != b':'
        || b[14] != b':'
        || b[17] != b':'
    {
        return Err(bad());
    }
    let day = number(&clock[0..2]).ok_or_else(bad)?;
    let month = MONTHS
        .iter()
        .position(|m| *m == &clock[3..6])
        .ok_or_else(bad)? as u64
        + 1;
    let year = number(&clock[7..11]).ok_or_else(bad)?;
    let hour = number(&clock[12..14]).ok_or_else(bad)?;
    let minute = number(&clock[15..17]).ok_or_else(bad)?;
    let second = number(&clock[18..20]).ok_or_else(bad)?;
    let micros = match &clock[20..] {
        "" => 0,
        rest => fraction_micros(rest.strip_prefix('.').ok_or_else(bad)?).ok_or_else(bad)?,
    };
    if zone.len() != 5 || !zone.starts_with(['+', '-']) {
        return Err(bad());
    }
    let offset = zone_seconds(zone.as_bytes()[0], &zone[1..3], &zone[3..5]).ok_or_else(bad)?;
    let local = unix_seconds(year, month, day, hour, minute, second).ok_or_else(bad)?;
    let utc = to_utc(local, offset).ok_or_else(bad)?;
    Ok(Duration::from_secs(utc) + Duration::from_micros(micros))
}

/// `hh:mm:ss[.frac]` and its offset in seconds east of UTC.
fn split_offset(rest: &str) -> Option<(&str, i64)> {
    if let Some(clock) = rest.strip_suffix(['Z', 'z']) {
        return Some((clock, 0));
    }
    let at = rest.rfind(['+', '-'])?;
    let (clock, zone) = rest.split_at(at);
    let zone = zone.as_bytes();
    if zone.len() != 6 || zone[3] != b':' {
        return None;
    }
    let zone_text = &rest[at..];
    Some((
        clock,
        zone_seconds(zone[0], &zone_text[1..3], &zone_text[4..6])?,
    ))
}

fn zone_seconds(sign: u8, hours: &str, minutes: &str) -> Option<i64> {
    let (hours, minutes) = (number(hours)?, number(minutes)?);
    if hours > 23 || minutes > 59 {
        return None;
    }
    let seconds = (hours * 3600 + minutes * 60) as i64;
    Some(if sign == b'-' { -seconds } else { seconds })
}

/// Local seconds at `offset` seconds east of UTC, as UTC seconds (none before 1970).
fn to_utc(local: u64, offset: i64) -> Option<u64> {
    u64::try_from(i64::try_from(local).ok()?.checked_sub(offset)?).ok()
}

/// Up to six digits of a second, as microseconds.
fn fraction_micros(fraction: &str) -> Option<u64> {
    if fraction.is_empty() {
        return Some(0);
    }
    if fraction.len() > 6 {
        return None;
    }
    Some(number(fraction)? * 10u64.pow(6 - fraction.len() as u32))
}

/// ASCII digits only (no sign, no spaces).
fn number(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn micros(d: Duration) -> u128 {
        d.as_micros()
    }

    #[test]
    fn seconds_are_read_to_the_microsecond() {
        assert_eq!(
            micros(parse_time("1733223600").unwrap()),
            1_733_223_600_000_000
        );
        assert_eq!(
            micros(parse_time("1733223600.000001").unwrap()),
            1_733_223_600_000_001
        );
        assert_eq!(micros(parse_time("12.5").unwrap()), 12_500_000);
        assert!(parse_time("12.1234567").is_err());
        assert!(parse_time("1.").is_err());
        // Milliseconds are not seconds.
        let error = parse_time("1733223600123").unwrap_err();
        assert!(error.contains("milliseconds"), "{error}");
        assert!(parse_time("2026-12-03T10:00:0€Z").is_err());
        assert!(parse_time("1.2.3").is_err());
        assert!(parse_time(".5").is_err());
        assert!(parse_time("").is_err());
    }

    #[test]
    fn rfc3339_is_utc_after_its_offset() {
        // date -u -d 2026-12-03T10:00:00Z +%s
        let base = 1_796_292_000u128 * 1_000_000;
        assert_eq!(micros(parse_time("2026-12-03T10:00:00Z").unwrap()), base);
        assert_eq!(
            micros(parse_time("2026-12-03 11:00:00.25+01:00").unwrap()),
            base + 250_000
        );
        assert_eq!(
            micros(parse_time("2026-12-03T09:30:00-00:30").unwrap()),
            base
        );
        assert_eq!(micros(parse_time("1970-01-01T00:00:00Z").unwrap()), 0);
        assert_eq!(
            micros(parse_time("2024-02-29T00:00:00Z").unwrap()),
            1_709_164_800_000_000
        );
        assert!(parse_time("2026-02-29T00:00:00Z").is_err());
        assert!(parse_time("2026-12-03T10:00:00").is_err());
        assert!(parse_time("2026-13-03T10:00:00Z").is_err());
    }

    #[test]
    fn access_log_dates_are_read_with_their_zone() {
        let base = 1_796_292_000u128 * 1_000_000;
        assert_eq!(
            micros(parse_log_date("03/Dec/2026:10:00:00 +0000").unwrap()),
            base
        );
        assert_eq!(
            micros(parse_log_date("03/Dec/2026:03:00:00 -0700").unwrap()),
            base
        );
        assert_eq!(
            micros(parse_log_date("03/Dec/2026:10:00:00.5 +0000").unwrap()),
            base + 500_000
        );
        assert!(parse_log_date("03/Dez/2026:10:00:00 +0000").is_err());
        assert!(parse_log_date("03/Dec/2026:10:00:00").is_err());
        // Multi-byte characters where digits belong: errors, never a panic.
        assert!(parse_log_date("03/Dec/2026:10:00:0€ +0000").is_err());
        assert!(parse_log_date("03/Dec/2026:10:00:00 +0é0").is_err());
        assert!(parse_log_date("€3/Dec/2026:10:00:00 +0000").is_err());
    }
}
