//! [`Engine`]: Lua 5.1, as Redis embeds it, running tollgate's own code on a simulated server:
//! function libraries (`FUNCTION LOAD`, `FCALL`) and scripts (`SCRIPT LOAD`, `EVALSHA`), with
//! `redis.call` and `redis.pcall` over the server's [`Keyspace`], and values converted between
//! Lua and RESP by the rules of Redis's scripting documentation ("Conversion between Lua and
//! Redis data types"): an integer reply is a number, a bulk string a string, a missing value
//! `false`, a status `{ok = ...}`, an error `{err = ...}` (raised by `redis.call`); a number
//! returned is an integer (truncated), a table an array up to its first `nil`.

use std::collections::HashMap;

use mlua::{Function, Lua, MultiValue, Table, Value};

use super::keyspace::Keyspace;
use super::reply::Reply;

/// What a call's `redis.call` reads and writes: the keyspace, moved in for the call, and the
/// server's time.
struct Running {
    keyspace: Keyspace,
    /// Server time, microseconds since the Unix epoch.
    now: u64,
}

/// A server's Lua: the libraries and scripts it holds.
pub(crate) struct Engine {
    lua: Lua,
    /// Functions registered by libraries, by name.
    functions: HashMap<String, Function>,
    /// Libraries loaded, by name.
    libraries: Vec<String>,
    /// Scripts loaded, by SHA-1.
    scripts: HashMap<String, Function>,
}

/// A Lua value as a command argument: strings as they are, numbers as Redis writes them.
fn argument(value: &Value) -> Result<Vec<u8>, String> {
    match value {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Integer(n) => Ok(n.to_string().into_bytes()),
        Value::Number(n) if n.fract() == 0.0 && n.abs() < 1e17 => {
            Ok(format!("{}", *n as i64).into_bytes())
        }
        Value::Number(n) => Ok(format!("{n}").into_bytes()),
        _ => Err("Lua redis lib command arguments must be strings or integers".into()),
    }
}

/// A reply as a Lua value (`Err`: an error reply, which `redis.call` raises).
fn to_lua(lua: &Lua, reply: Reply) -> mlua::Result<Result<Value, String>> {
    Ok(Ok(match reply {
        Reply::Status(s) => {
            let t = lua.create_table()?;
            t.raw_set("ok", s)?;
            Value::Table(t)
        }
        Reply::Error(e) => return Ok(Err(e)),
        Reply::Integer(n) => Value::Integer(n),
        Reply::Bulk(b) => Value::String(lua.create_string(b)?),
        Reply::Nil => Value::Boolean(false),
        Reply::Array(items) => {
            let t = lua.create_table()?;
            for (i, item) in items.into_iter().enumerate() {
                let value = match to_lua(lua, item)? {
                    Ok(v) => v,
                    Err(e) => {
                        let err = lua.create_table()?;
                        err.raw_set("err", e)?;
                        Value::Table(err)
                    }
                };
                t.raw_set(i + 1, value)?;
            }
            Value::Table(t)
        }
    }))
}

/// A script's returned value as a reply.
fn to_reply(value: &Value) -> Reply {
    match value {
        Value::Integer(n) => Reply::Integer(*n),
        Value::Number(n) => Reply::Integer(n.trunc() as i64),
        Value::String(s) => Reply::Bulk(s.as_bytes().to_vec()),
        Value::Boolean(true) => Reply::Integer(1),
        Value::Boolean(false) | Value::Nil => Reply::Nil,
        Value::Table(t) => {
            if let Ok(Value::String(ok)) = t.raw_get::<Value>("ok") {
                return Reply::Status(ok.to_string_lossy());
            }
            if let Ok(Value::String(err)) = t.raw_get::<Value>("err") {
                return Reply::Error(err.to_string_lossy());
            }
            let mut items = Vec::new();
            for i in 1.. {
                match t.raw_get::<Value>(i) {
                    Ok(Value::Nil) | Err(_) => break,
                    Ok(v) => items.push(to_reply(&v)),
                }
            }
            Reply::Array(items)
        }
        _ => Reply::Nil,
    }
}

/// Runs one command of a script on the keyspace of the call.
fn command(lua: &Lua, args: &MultiValue) -> Result<Reply, String> {
    let args: Vec<Vec<u8>> = args.iter().map(argument).collect::<Result<_, _>>()?;
    let Some(name) = args.first() else {
        return Err("ERR Please specify at least one argument for this redis lib call".into());
    };
    let name = String::from_utf8_lossy(name).to_ascii_uppercase();
    let mut running = lua
        .app_data_mut::<Running>()
        .ok_or_else(|| "ERR redis.call outside a call".to_string())?;
    if name == "TIME" {
        let now = running.now;
        return Ok(Reply::Array(vec![
            Reply::Bulk((now / 1_000_000).to_string().into_bytes()),
            Reply::Bulk((now % 1_000_000).to_string().into_bytes()),
        ]));
    }
    let now_ms = running.now / 1000;
    match running.keyspace.run(&name, &args[1..], now_ms) {
        Some(reply) => Ok(reply),
        None => Err(format!(
            "ERR unknown command '{}' called from script",
            name.to_ascii_lowercase()
        )),
    }
}

impl Engine {
    /// A server's Lua, with the `redis` library.
    pub(crate) fn new() -> Engine {
        let lua = Lua::new();
        let redis = lua.create_table().expect("a table");
        let call = lua
            .create_function(|lua, args: MultiValue| match command(lua, &args) {
                Ok(reply) => match to_lua(lua, reply)? {
                    Ok(value) => Ok(value),
                    Err(error) => Err(mlua::Error::runtime(error)),
                },
                Err(error) => Err(mlua::Error::runtime(error)),
            })
            .expect("redis.call");
        let pcall = lua
            .create_function(|lua, args: MultiValue| {
                let reply = command(lua, &args).unwrap_or_else(Reply::Error);
                match to_lua(lua, reply)? {
                    Ok(value) => Ok(value),
                    Err(error) => {
                        let t = lua.create_table()?;
                        t.raw_set("err", error)?;
                        Ok(Value::Table(t))
                    }
                }
            })
            .expect("redis.pcall");
        let error_reply = lua
            .create_function(|lua, message: String| {
                let t = lua.create_table()?;
                t.raw_set("err", message)?;
                Ok(t)
            })
            .expect("redis.error_reply");
        let status_reply = lua
            .create_function(|lua, message: String| {
                let t = lua.create_table()?;
                t.raw_set("ok", message)?;
                Ok(t)
            })
            .expect("redis.status_reply");
        let replicate = lua
            .create_function(|_, ()| Ok(true))
            .expect("redis.replicate_commands");
        redis.raw_set("call", call).expect("set");
        redis.raw_set("pcall", pcall).expect("set");
        redis.raw_set("error_reply", error_reply).expect("set");
        redis.raw_set("status_reply", status_reply).expect("set");
        redis.raw_set("replicate_commands", replicate).expect("set");
        lua.globals().raw_set("redis", redis).expect("set");
        Engine {
            lua,
            functions: HashMap::new(),
            libraries: Vec::new(),
            scripts: HashMap::new(),
        }
    }

    /// Forgets every library and script (a restart).
    pub(crate) fn flush(&mut self, libraries: bool) {
        self.scripts.clear();
        if libraries {
            self.functions.clear();
            self.libraries.clear();
        }
    }

    /// `FUNCTION LOAD code`: runs the library's code, which registers its functions.
    pub(crate) fn load_library(&mut self, code: &[u8]) -> Reply {
        let text = String::from_utf8_lossy(code);
        let Some(name) = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("#!lua name="))
            .map(|n| n.trim().to_owned())
        else {
            return Reply::Error("ERR Missing library metadata".into());
        };
        if self.libraries.contains(&name) {
            return Reply::Error(format!("ERR Library '{name}' already exists"));
        }
        let registered: Table = self.lua.create_table().expect("a table");
        let into = registered.clone();
        let register = self
            .lua
            .create_function(move |_, (name, f): (String, Function)| into.raw_set(name, f))
            .expect("register_function");
        let redis: Table = self.lua.globals().raw_get("redis").expect("redis");
        redis.raw_set("register_function", register).expect("set");
        // The shebang line is not Lua.
        let body: String = text.lines().skip(1).collect::<Vec<_>>().join("\n");
        let loaded = self.lua.load(body).set_name(name.clone()).exec();
        let _ = redis.raw_set("register_function", Value::Nil);
        if let Err(e) = loaded {
            return Reply::Error(format!("ERR Error compiling function: {e}"));
        }
        for pair in registered.pairs::<String, Function>() {
            let Ok((function, f)) = pair else { continue };
            self.functions.insert(function, f);
        }
        self.libraries.push(name.clone());
        Reply::Bulk(name.into_bytes())
    }

    /// `SCRIPT LOAD code`: its SHA-1.
    pub(crate) fn load_script(&mut self, code: &[u8]) -> Reply {
        let text = String::from_utf8_lossy(code).into_owned();
        let sha = redis::Script::new(&text).get_hash().to_owned();
        match self
            .lua
            .load(text)
            .set_name(format!("f_{sha}"))
            .into_function()
        {
            Ok(f) => {
                self.scripts.insert(sha.clone(), f);
                Reply::Bulk(sha.into_bytes())
            }
            Err(e) => Reply::Error(format!("ERR Error compiling script: {e}")),
        }
    }

    /// `FCALL name` or `EVALSHA sha` of `keys` and `args` on `keyspace` at server time `now`:
    /// the reply, and the keyspace back.
    pub(crate) fn call(
        &mut self,
        function: bool,
        name: &str,
        keys: &[Vec<u8>],
        args: &[Vec<u8>],
        keyspace: Keyspace,
        now: u64,
    ) -> (Reply, Keyspace) {
        let f = if function {
            match self.functions.get(name) {
                Some(f) => f.clone(),
                None => return (Reply::Error("ERR Function not found".into()), keyspace),
            }
        } else {
            match self.scripts.get(&name.to_ascii_lowercase()) {
                Some(f) => f.clone(),
                None => {
                    return (
                        Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into()),
                        keyspace,
                    );
                }
            }
        };
        let lua = &self.lua;
        let table = |items: &[Vec<u8>]| -> Table {
            let t = lua.create_table().expect("a table");
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, lua.create_string(item).expect("a string"))
                    .expect("set");
            }
            t
        };
        let (keys, args) = (table(keys), table(args));
        lua.set_app_data(Running { keyspace, now });
        let result = if function {
            f.call::<Value>((keys, args))
        } else {
            let globals = lua.globals();
            globals.raw_set("KEYS", keys).expect("set");
            globals.raw_set("ARGV", args).expect("set");
            f.call::<Value>(())
        };
        let running = lua
            .remove_app_data::<Running>()
            .expect("the call's keyspace");
        let reply = match result {
            Ok(value) => to_reply(&value),
            Err(e) => Reply::Error(format!("ERR {}", error_text(&e))),
        };
        (reply, running.keyspace)
    }
}

/// The message of a Lua error, without mlua's wrapping.
fn error_text(error: &mlua::Error) -> String {
    match error {
        mlua::Error::CallbackError { cause, .. } => error_text(cause),
        mlua::Error::RuntimeError(m) => m.clone(),
        other => other.to_string(),
    }
}
