//! [`Traffic`]: recorded requests read from JSON lines, CSV or an access log, line by line.

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::path::Path;
use std::str::FromStr;

use http::uri::PathAndQuery;
use http::{HeaderName, HeaderValue, Method};

use super::arrival::Arrival;
use super::time::{parse_log_date, parse_time};

/// The shape of a traffic file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// One JSON object per line: `time` and `path` (required), `ip`, `method` (default `GET`),
    /// `key`, `cost`, `actual_cost`, `status` and `headers` (an object of strings). Other
    /// fields are ignored. See [`Arrival`] for what each field holds: `status` is what the
    /// replay answers the request with, `actual_cost` what it settles a
    /// [`settle`](crate::Rule::settle) rule at; both are optional.
    JsonLines,
    /// Comma-separated values under a header line naming the columns, in any order: `time`
    /// and `path` (required), `ip`, `method`, `key`, `cost`, `actual_cost`, `status`. A value
    /// may be quoted (`"a,b"`, `""` for a quote inside); an empty value is absent.
    Csv,
    /// The common or combined access log of nginx and Apache:
    /// `203.0.113.7 - - [03/Dec/2026:10:00:00 +0000] "GET /search?q=x HTTP/1.1" 429 17 ...`
    /// (client IP, time, method, path, status; no key).
    AccessLog,
}

impl Format {
    /// The format a file's extension names: `.jsonl`, `.ndjson` and `.json` (JSON lines),
    /// `.csv`, `.log` (access log).
    pub fn of_path(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "jsonl" | "ndjson" | "json" => Some(Format::JsonLines),
            "csv" => Some(Format::Csv),
            "log" => Some(Format::AccessLog),
            _ => None,
        }
    }
}

/// A line of traffic that could not be read: which line, and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TrafficError {
    /// The line, counted from 1 (none when the file could not be opened).
    pub line: Option<u64>,
    /// What is wrong.
    pub message: String,
}

impl TrafficError {
    fn at(line: u64, message: impl Into<String>) -> Self {
        TrafficError {
            line: Some(line),
            message: message.into(),
        }
    }
}

impl fmt::Display for TrafficError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for TrafficError {}

/// Recorded requests read line by line: an iterator of [`Arrival`]s that stops at the first
/// line it cannot read, with an error naming that line. Blank lines are skipped.
///
/// ```
/// use tollgate::replay::{Format, Traffic};
///
/// let csv = "time,ip,path,key\n0.5,203.0.113.7,/search,pro-1\n1,203.0.113.8,/,\n";
/// let arrivals: Vec<_> = Traffic::new(csv.as_bytes(), Format::Csv).collect::<Result<_, _>>()?;
/// assert_eq!(arrivals.len(), 2);
/// assert_eq!(arrivals[0].key.as_deref(), Some("pro-1"));
/// assert_eq!(arrivals[1].key, None);
///
/// let bad = "time,path\n1,/\nsoon,/\n";
/// let error = Traffic::new(bad.as_bytes(), Format::Csv).find_map(Result::err).unwrap();
/// assert_eq!(error.line, Some(3));
/// # Ok::<(), tollgate::replay::TrafficError>(())
/// ```
pub struct Traffic<R> {
    reader: R,
    format: Format,
    line: u64,
    buffer: String,
    columns: Option<Vec<Column>>,
    done: bool,
}

impl<R: BufRead> Traffic<R> {
    /// Reads `reader` as `format`.
    pub fn new(reader: R, format: Format) -> Self {
        Traffic {
            reader,
            format,
            line: 0,
            buffer: String::new(),
            columns: None,
            done: false,
        }
    }
}

impl Traffic<BufReader<File>> {
    /// Opens a file, in the format its extension names ([`Format::of_path`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TrafficError> {
        let path = path.as_ref();
        let format = Format::of_path(path).ok_or_else(|| TrafficError {
            line: None,
            message: format!(
                "{}: the extension names no format (.jsonl, .csv or .log); use Traffic::open_as",
                path.display()
            ),
        })?;
        Self::open_as(path, format)
    }

    /// Opens a file in `format`.
    pub fn open_as(path: impl AsRef<Path>, format: Format) -> Result<Self, TrafficError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| TrafficError {
            line: None,
            message: format!("cannot open {}: {e}", path.display()),
        })?;
        Ok(Traffic::new(BufReader::new(file), format))
    }
}

impl<R> fmt::Debug for Traffic<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Traffic")
            .field("format", &self.format)
            .field("line", &self.line)
            .finish_non_exhaustive()
    }
}

impl<R: BufRead> Iterator for Traffic<R> {
    type Item = Result<Arrival, TrafficError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            self.buffer.clear();
            self.line += 1;
            let line = self.line;
            match self.reader.read_line(&mut self.buffer) {
                Ok(0) => self.done = true,
                Ok(_) => {
                    let mut text = self.buffer.trim_end_matches(['\n', '\r']);
                    if line == 1 {
                        // A byte-order mark, as spreadsheets write.
                        text = text.strip_prefix('\u{feff}').unwrap_or(text);
                    }
                    if text.trim().is_empty() {
                        continue;
                    }
                    let read = match self.format {
                        Format::JsonLines => json_line(text),
                        Format::AccessLog => log_line(text),
                        Format::Csv => match &self.columns {
                            None => match csv_header(text) {
                                Ok(columns) => {
                                    self.columns = Some(columns);
                                    continue;
                                }
                                Err(e) => Err(e),
                            },
                            Some(columns) => csv_line(columns, text),
                        },
                    };
                    return Some(match read {
                        Ok(arrival) => Ok(arrival.line(line)),
                        Err(message) => {
                            self.done = true;
                            Err(TrafficError::at(line, message))
                        }
                    });
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(TrafficError::at(line, format!("cannot be read: {e}"))));
                }
            }
        }
        None
    }
}

/// The fields of one request, checked as they are set.
#[derive(Default)]
struct Fields {
    time: Option<std::time::Duration>,
    ip: Option<IpAddr>,
    method: Option<Method>,
    path: Option<String>,
    key: Option<String>,
    cost: Option<u64>,
    actual_cost: Option<u64>,
    status: Option<u16>,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Fields {
    fn set(&mut self, column: Column, value: &str) -> Result<(), String> {
        match column {
            Column::Time => self.time = Some(parse_time(value)?),
            Column::Ip => {
                self.ip = Some(
                    value
                        .parse()
                        .map_err(|_| format!("`{value}` is not an IP address"))?,
                )
            }
            Column::Method => {
                self.method = Some(
                    Method::from_str(value).map_err(|_| format!("`{value}` is not a method"))?,
                )
            }
            Column::Path => {
                if !value.starts_with('/') || PathAndQuery::from_str(value).is_err() {
                    return Err(format!("`{value}` is not a path (like /search?q=x)"));
                }
                self.path = Some(value.to_owned());
            }
            Column::Key => {
                HeaderValue::from_str(value)
                    .map_err(|_| format!("the key `{value}` cannot be sent in a header"))?;
                self.key = Some(value.to_owned());
            }
            Column::Cost => {
                self.cost = Some(
                    value
                        .parse()
                        .map_err(|_| format!("the cost `{value}` is not a whole number"))?,
                )
            }
            Column::ActualCost => {
                self.actual_cost = Some(
                    value
                        .parse()
                        .map_err(|_| format!("the actual cost `{value}` is not a whole number"))?,
                )
            }
            Column::Status => {
                self.status = Some(
                    value
                        .parse()
                        .ok()
                        .filter(|s| (100..=999).contains(s))
                        .ok_or_else(|| format!("the status `{value}` is not an HTTP status"))?,
                )
            }
        }
        Ok(())
    }

    fn arrival(self) -> Result<Arrival, String> {
        let at = self.time.ok_or("no time")?;
        let path = self.path.ok_or("no path")?;
        let mut arrival = Arrival::new(at, self.method.unwrap_or(Method::GET), path);
        arrival.ip = self.ip;
        arrival.key = self.key;
        arrival.cost = self.cost;
        arrival.actual_cost = self.actual_cost;
        arrival.status = self.status;
        arrival.headers = self.headers;
        Ok(arrival)
    }
}

/// The columns of a CSV file, and the fields of a JSON line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Column {
    Time,
    Ip,
    Method,
    Path,
    Key,
    Cost,
    ActualCost,
    Status,
}

impl Column {
    const ALL: [(&'static str, Column); 8] = [
        ("time", Column::Time),
        ("ip", Column::Ip),
        ("method", Column::Method),
        ("path", Column::Path),
        ("key", Column::Key),
        ("cost", Column::Cost),
        ("actual_cost", Column::ActualCost),
        ("status", Column::Status),
    ];

    fn named(name: &str) -> Option<Column> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|&(_, c)| c)
    }
}

fn json_line(text: &str) -> Result<Arrival, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let serde_json::Value::Object(object) = value else {
        return Err("not a JSON object".to_owned());
    };
    let mut fields = Fields::default();
    for (name, value) in &object {
        if name == "headers" {
            let serde_json::Value::Object(headers) = value else {
                return Err("`headers` is not an object".to_owned());
            };
            for (name, value) in headers {
                let header = HeaderName::from_str(name)
                    .map_err(|_| format!("`{name}` is not a header name"))?;
                let value = value
                    .as_str()
                    .and_then(|v| HeaderValue::from_str(v).ok())
                    .ok_or_else(|| {
                        format!("the header `{name}` is not a string a header may hold")
                    })?;
                fields.headers.push((header, value));
            }
            continue;
        }
        let Some(column) = Column::named(name) else {
            continue;
        };
        let text = match value {
            serde_json::Value::Null => continue,
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            _ => return Err(format!("`{name}` is neither a string nor a number")),
        };
        fields
            .set(column, &text)
            .map_err(|e| format!("`{name}`: {e}"))?;
    }
    fields.arrival()
}

fn csv_header(text: &str) -> Result<Vec<Column>, String> {
    let names = csv_values(text)?;
    let mut columns = Vec::with_capacity(names.len());
    for name in &names {
        let column = Column::named(name.trim()).ok_or_else(|| {
            format!(
                "the header names a column `{name}`; the columns are time, ip, method, path, \
                 key, cost, actual_cost and status"
            )
        })?;
        if columns.contains(&column) {
            return Err(format!("the header names `{name}` twice"));
        }
        columns.push(column);
    }
    for required in [Column::Time, Column::Path] {
        if !columns.contains(&required) {
            return Err(format!(
                "the header has no column `{}`",
                if required == Column::Time {
                    "time"
                } else {
                    "path"
                }
            ));
        }
    }
    Ok(columns)
}

fn csv_line(columns: &[Column], text: &str) -> Result<Arrival, String> {
    let values = csv_values(text)?;
    if values.len() != columns.len() {
        return Err(format!(
            "{} values under a header of {} columns",
            values.len(),
            columns.len()
        ));
    }
    let mut fields = Fields::default();
    for (&column, value) in columns.iter().zip(&values) {
        if !value.is_empty() {
            fields.set(column, value)?;
        }
    }
    fields.arrival()
}

/// The values of one CSV line: separated by commas, each plain or in double quotes.
fn csv_values(text: &str) -> Result<Vec<String>, String> {
    let mut values = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        value.push('"');
                    }
                    Some('"') => break,
                    Some(c) => value.push(c),
                    None => return Err("a quoted value is not closed".to_owned()),
                }
            }
            match chars.next() {
                None => {
                    values.push(value);
                    return Ok(values);
                }
                Some(',') => values.push(value),
                Some(c) => return Err(format!("`{c}` after a quoted value")),
            }
        } else {
            loop {
                match chars.next() {
                    None => {
                        values.push(value);
                        return Ok(values);
                    }
                    Some(',') => break,
                    Some('"') => return Err("a quote inside an unquoted value".to_owned()),
                    Some(c) => value.push(c),
                }
            }
            values.push(value);
        }
    }
}

/// `ip ident user [date] "METHOD path PROTOCOL" status ...`
fn log_line(text: &str) -> Result<Arrival, String> {
    let shape = "not an access log line (ip - - [date] \"METHOD /path HTTP/1.1\" status ...)";
    let (ip, rest) = text.split_once(' ').ok_or(shape)?;
    let open = rest.find('[').ok_or(shape)?;
    let close = open + rest[open..].find(']').ok_or(shape)?;
    let date = &rest[open + 1..close];
    let rest = rest[close + 1..].trim_start();
    let rest = rest.strip_prefix('"').ok_or(shape)?;
    let end = rest.find('"').ok_or(shape)?;
    let request = &rest[..end];
    let status = rest[end + 1..].split_whitespace().next().ok_or(shape)?;

    let mut fields = Fields::default();
    fields.set(Column::Ip, ip)?;
    fields.time = Some(parse_log_date(date)?);
    let mut parts = request.split(' ');
    let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
        return Err(format!(
            "the request `{request}` is not `METHOD /path PROTOCOL`"
        ));
    };
    fields.set(Column::Method, method)?;
    fields.set(Column::Path, path)?;
    fields.set(Column::Status, status)?;
    fields.arrival()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn read(text: &str, format: Format) -> Vec<Result<Arrival, TrafficError>> {
        Traffic::new(text.as_bytes(), format).collect()
    }

    #[test]
    fn json_lines_read_every_field_and_ignore_others() {
        let text = "{\"time\": 1733223600.25, \"ip\": \"203.0.113.7\", \"method\": \"POST\", \
                    \"path\": \"/search?q=x\", \"key\": \"pro-1\", \"cost\": 3, \"actual_cost\": 7, \"status\": 401, \
                    \"headers\": {\"x-tenant\": \"acme\"}, \"agent\": \"curl\"}\n\n{\"time\": \"2026-12-03T10:00:00Z\", \"path\": \"/\"}\n";
        let arrivals: Vec<_> = read(text, Format::JsonLines)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let first = &arrivals[0];
        assert_eq!(first.at, Duration::from_micros(1_733_223_600_250_000));
        assert_eq!(first.ip, Some("203.0.113.7".parse().unwrap()));
        assert_eq!(first.method, Method::POST);
        assert_eq!(first.path, "/search?q=x");
        assert_eq!(first.key.as_deref(), Some("pro-1"));
        assert_eq!(first.cost, Some(3));
        assert_eq!(first.actual_cost, Some(7));
        assert_eq!(first.status, Some(401));
        assert_eq!(first.headers[0].0, "x-tenant");
        assert_eq!(first.line, Some(1));
        assert_eq!(arrivals[1].method, Method::GET);
        assert_eq!((arrivals[1].actual_cost, arrivals[1].status), (None, None));
        assert_eq!(arrivals[1].line, Some(3));
    }

    #[test]
    fn a_bad_line_is_an_error_that_names_it_and_ends_the_traffic() {
        for (text, line, says) in [
            (
                "{\"time\": 1, \"path\": \"/\"}\n{\"time\": 2}\n",
                2,
                "no path",
            ),
            ("{\"time\": 1, \"path\": \"/\"}\nnot json\n", 2, "not JSON"),
            (
                "{\"time\": 1, \"path\": \"/\", \"ip\": \"10.0.0\"}\n",
                1,
                "not an IP",
            ),
            ("{\"time\": 1, \"path\": \"search\"}\n", 1, "not a path"),
            ("{\"time\": -1, \"path\": \"/\"}\n", 1, "time"),
            ("{\"time\": 1, \"path\": \"/\", \"cost\": 1.5}\n", 1, "cost"),
            (
                "{\"time\": 1, \"path\": \"/\", \"actual_cost\": -2}\n",
                1,
                "actual cost",
            ),
        ] {
            let read = read(text, Format::JsonLines);
            let error = read.last().unwrap().as_ref().unwrap_err();
            assert_eq!(error.line, Some(line), "{text}");
            assert!(error.message.contains(says), "{error} does not say {says}");
        }
    }

    #[test]
    fn csv_reads_under_its_header_with_quotes() {
        let text = "\u{feff}path,time,key,method,actual_cost,status\n\"/a,b\",1,\"say \"\"hi\"\"\",,12,401\n/c,2,,PUT,,\n";
        let arrivals: Vec<_> = read(text, Format::Csv)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(arrivals[0].path, "/a,b");
        assert_eq!(arrivals[0].key.as_deref(), Some("say \"hi\""));
        assert_eq!(arrivals[0].line, Some(2));
        assert_eq!(arrivals[0].actual_cost, Some(12));
        assert_eq!(arrivals[0].status, Some(401));
        assert_eq!(arrivals[1].method, Method::PUT);
        assert_eq!(arrivals[1].actual_cost, None);
        assert_eq!(arrivals[1].key, None);

        for (text, line, says) in [
            ("time,path,colour\n", 1, "colour"),
            ("time\n", 1, "no column `path`"),
            ("time,path\n1,/,x\n", 2, "3 values"),
            ("time,path\n1,\"/\n", 2, "not closed"),
        ] {
            let error = read(text, Format::Csv).pop().unwrap().unwrap_err();
            assert_eq!(error.line, Some(line), "{text}");
            assert!(error.message.contains(says), "{error} does not say {says}");
        }
    }

    #[test]
    fn access_logs_give_ip_time_method_path_and_status() {
        let text = "203.0.113.7 - alice [03/Dec/2026:10:00:00 +0000] \"GET /search?q=x HTTP/1.1\" 429 17 \"-\" \"curl/8\"\n\
                    2001:db8::1 - - [03/Dec/2026:10:00:01 +0000] \"POST / HTTP/2.0\" 200 2\n";
        let arrivals: Vec<_> = read(text, Format::AccessLog)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(arrivals[0].at, Duration::from_secs(1_796_292_000));
        assert_eq!(arrivals[0].path, "/search?q=x");
        assert_eq!(arrivals[0].status, Some(429));
        assert_eq!(arrivals[1].ip, Some("2001:db8::1".parse().unwrap()));
        assert_eq!(arrivals[1].method, Method::POST);

        let error = read(
            "203.0.113.7 - - [03/Dec/2026:10:00:00 +0000] \"GET\" 200 1\n",
            Format::AccessLog,
        )
        .pop()
        .unwrap()
        .unwrap_err();
        assert_eq!(error.line, Some(1));
        assert!(error.message.contains("METHOD /path"), "{error}");
    }
}
