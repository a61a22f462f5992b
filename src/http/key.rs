//! Where the entity id of a request comes from: [`EntityKey`], and the client IP behind trusted
//! proxies ([`TrustedProxies`], [`client_ip`]).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::ConnectInfo;
use axum::extract::connect_info::MockConnectInfo;
use axum::http::Extensions;
use axum::http::HeaderMap;
use axum::http::header::HeaderName;
use axum::http::request::Parts;

use super::head::Head;

/// The longest `X-Forwarded-For` (all its header lines together) that is read at all; a longer
/// one is ignored and the peer address is used.
pub const MAX_FORWARDED_BYTES: usize = 4096;

/// The most `X-Forwarded-For` entries walked from the right looking for the first untrusted
/// address; past it the peer address is used.
pub const MAX_FORWARDED_HOPS: usize = 16;

/// A closure that finds the entity id in a request's head.
type KeyFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Where the entity layer finds the entity id of a request. A request without one skips the
/// entity check (it is not denied).
#[derive(Clone)]
pub struct EntityKey {
    source: Source,
}

#[derive(Clone)]
enum Source {
    PathParam(String),
    Header(HeaderName),
    ClientIp,
    Fn(Arc<KeyFn>),
}

impl fmt::Debug for EntityKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Source::PathParam(name) => f.debug_tuple("PathParam").field(name).finish(),
            Source::Header(name) => f.debug_tuple("Header").field(name).finish(),
            Source::ClientIp => f.write_str("ClientIp"),
            Source::Fn(_) => f.write_str("Fn(..)"),
        }
    }
}

impl EntityKey {
    /// The named path parameter of the matched route (`bookingId` for `/bookings/{bookingId}`),
    /// percent-decoded. A value that is not UTF-8 once decoded (`%FF`) is malformed: the layer
    /// answers `400 Bad Request` before touching any bucket.
    pub fn path_param(name: impl Into<String>) -> Self {
        EntityKey {
            source: Source::PathParam(name.into()),
        }
    }

    /// A request header, such as an API key. An absent or empty header skips the entity check.
    /// The value is the id exactly as sent, never trimmed; a value that is not UTF-8, starts or
    /// ends with a space or tab, or is sent on more than one header line is malformed: the
    /// layer answers `400 Bad Request` before touching any bucket.
    ///
    /// The name is a [`HeaderName`] (`HeaderName::from_static("x-api-key")`, or
    /// `HeaderName::try_from(text)?` for a name read at run time), so an invalid one is refused
    /// where it is made, never by a panic here.
    pub fn header(name: HeaderName) -> Self {
        EntityKey {
            source: Source::Header(name),
        }
    }

    /// The client's IP address: the peer address (axum's `ConnectInfo<SocketAddr>`), or, when
    /// the peer is one of the layer's [trusted proxies](super::RateLimitLayer::trusted_proxies),
    /// the rightmost untrusted address in `X-Forwarded-For` (see [`client_ip`]).
    pub fn client_ip() -> Self {
        EntityKey {
            source: Source::ClientIp,
        }
    }

    /// Anything else: a closure over the request head (method, URI, headers, extensions).
    /// `None` skips the entity check.
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        EntityKey {
            source: Source::Fn(Arc::new(f)),
        }
    }

    /// The path parameter's name, for a key read from one.
    pub(crate) fn path_param_name(&self) -> Option<&str> {
        match &self.source {
            Source::PathParam(name) => Some(name),
            _ => None,
        }
    }

    /// Whether [`extract`](Self::extract) reads path parameters.
    pub(crate) fn needs_path_params(&self) -> bool {
        matches!(self.source, Source::PathParam(_))
    }

    /// Whether its id is read from the request's parts themselves: the application's own
    /// function's ([`from_fn`](Self::from_fn)), which takes `&Parts`.
    pub(crate) fn needs_parts(&self) -> bool {
        matches!(self.source, Source::Fn(_))
    }

    /// The entity id of a request, `None` to skip the entity check, or why the id is malformed.
    /// `params` are the matched route's path parameters (name, percent-decoded value, or why
    /// the value is malformed).
    ///
    /// An id is kept exactly as the request carries it, so two different ids never share a
    /// bucket: a path parameter that is not UTF-8 once percent-decoded, a header value that is
    /// not UTF-8, has leading or trailing whitespace or appears on more than one header line,
    /// is malformed rather than decoded lossily or trimmed into some other id.
    ///
    /// A key that [`needs_parts`](Self::needs_parts) reads them from `head`; given a whole
    /// request, it has no id (the layer checks such a route on the parts).
    pub(crate) fn extract(
        &self,
        head: &mut impl Head,
        params: &[(String, ParamValue)],
        trusted: &TrustedProxies,
    ) -> Result<Option<String>, MalformedId> {
        let id = match &self.source {
            Source::PathParam(name) => match params.iter().find(|(n, _)| n == name) {
                Some((_, value)) => Some(value.clone()?),
                None => None,
            },
            Source::Header(name) => header_id(head.headers(), name)?,
            Source::ClientIp => peer_addr(head.extensions())
                .map(|peer| client_ip(peer.ip(), head.headers(), trusted).to_string()),
            Source::Fn(f) => head.parts().and_then(|parts| f(parts)),
        };
        Ok(id.filter(|id| !id.is_empty()))
    }
}

/// Why a request's entity id was refused before any bucket was touched: the layer answers
/// `400 Bad Request`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum MalformedId {
    /// A path parameter is not valid UTF-8 once percent-decoded (`%FF`).
    PathNotUtf8 {
        /// The parameter's name, when known.
        name: Option<String>,
    },
    /// The header value is not valid UTF-8.
    HeaderNotUtf8 {
        /// The header's name.
        header: HeaderName,
    },
    /// The header value starts or ends with a space or tab.
    HeaderWhitespace {
        /// The header's name.
        header: HeaderName,
    },
    /// The header appears on more than one line.
    HeaderRepeated {
        /// The header's name.
        header: HeaderName,
    },
}

impl fmt::Display for MalformedId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MalformedId::PathNotUtf8 { name: Some(name) } => write!(
                f,
                "the path parameter {name} is not valid UTF-8 once percent-decoded"
            ),
            MalformedId::PathNotUtf8 { name: None } => {
                f.write_str("a path parameter is not valid UTF-8 once percent-decoded")
            }
            MalformedId::HeaderNotUtf8 { header } => {
                write!(f, "the {header} header is not valid UTF-8")
            }
            MalformedId::HeaderWhitespace { header } => {
                write!(f, "the {header} header has leading or trailing whitespace")
            }
            MalformedId::HeaderRepeated { header } => {
                write!(f, "the {header} header appears more than once")
            }
        }
    }
}

/// A path parameter's value: percent-decoded, or why it is malformed.
pub(crate) type ParamValue = Result<String, MalformedId>;

/// The entity id in header `name`: `None` when absent, the value exactly as sent otherwise.
fn header_id(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, MalformedId> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(MalformedId::HeaderRepeated {
            header: name.clone(),
        });
    }
    let bytes = value.as_bytes();
    let padded = |b: Option<&u8>| matches!(b, Some(b' ' | b'\t'));
    if padded(bytes.first()) || padded(bytes.last()) {
        return Err(MalformedId::HeaderWhitespace {
            header: name.clone(),
        });
    }
    match std::str::from_utf8(bytes) {
        Ok(id) => Ok(Some(id.to_owned())),
        Err(_) => Err(MalformedId::HeaderNotUtf8 {
            header: name.clone(),
        }),
    }
}

/// The peer address axum recorded: `ConnectInfo<SocketAddr>` (from
/// `into_make_service_with_connect_info`), or `MockConnectInfo<SocketAddr>` in tests.
pub(crate) fn peer_addr(extensions: &Extensions) -> Option<SocketAddr> {
    if let Some(ConnectInfo(addr)) = extensions.get::<ConnectInfo<SocketAddr>>() {
        return Some(*addr);
    }
    extensions
        .get::<MockConnectInfo<SocketAddr>>()
        .map(|MockConnectInfo(addr)| *addr)
}

/// The proxies whose `X-Forwarded-For` is believed: single addresses and CIDR blocks.
///
/// Empty by default, which means `X-Forwarded-For` is never read. Only list proxies you run:
/// anybody else can write any address into the header.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    nets: Vec<Cidr>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// A trusted proxy entry that is neither an IP address nor a CIDR block.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid trusted proxy {entry:?}: expected an IP address or CIDR block such as 10.0.0.0/8")]
pub struct TrustedProxyError {
    /// The entry as given.
    pub entry: String,
}

impl TrustedProxies {
    /// No trusted proxies: `X-Forwarded-For` is ignored.
    pub fn none() -> Self {
        TrustedProxies::default()
    }

    /// Parses addresses (`10.0.0.1`, `::1`) and CIDR blocks (`10.0.0.0/8`, `fd00::/8`).
    ///
    /// # Errors
    ///
    /// [`TrustedProxyError`] naming the first entry that is neither.
    pub fn parse<I, S>(entries: I) -> Result<Self, TrustedProxyError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut nets = Vec::new();
        for entry in entries {
            let entry = entry.as_ref().trim();
            let bad = || TrustedProxyError {
                entry: entry.to_owned(),
            };
            let (addr, prefix) = match entry.split_once('/') {
                Some((addr, prefix)) => (addr, Some(prefix)),
                None => (entry, None),
            };
            let addr: IpAddr = addr.parse().map_err(|_| bad())?;
            let addr = addr.to_canonical();
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let prefix = match prefix {
                Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(bad)?,
                None => max,
            };
            nets.push(Cidr { addr, prefix });
        }
        Ok(TrustedProxies { nets })
    }

    /// Whether `ip` is a trusted proxy.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.iter().any(|net| net.contains(ip))
    }

    /// Whether no proxy is trusted.
    pub fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }
}

/// The client's address for a request from `peer` with `headers`.
///
/// `X-Forwarded-For` is read only when `peer` is a trusted proxy. Then its entries are walked
/// from the right (the entry the nearest proxy appended) and the first address that is not a
/// trusted proxy is the client: entries to its left were written by the client or by proxies
/// nobody vouches for, so they are ignored. An empty, malformed or oversized header (over
/// [`MAX_FORWARDED_BYTES`], or more than [`MAX_FORWARDED_HOPS`] trusted hops) gives `peer`.
/// Never panics, never allocates.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &TrustedProxies) -> IpAddr {
    let peer = peer.to_canonical();
    if !trusted.contains(peer) {
        return peer;
    }
    let values = headers.get_all("x-forwarded-for");
    let total: usize = values.iter().map(|v| v.len() + 1).sum();
    if total > MAX_FORWARDED_BYTES {
        return peer;
    }
    let mut client = peer;
    let mut hops = 0;
    // Header lines in order form one list; walk the last line first.
    for line in values.iter().rev() {
        let Ok(line) = line.to_str() else {
            return peer;
        };
        for entry in line.rsplit(',') {
            hops += 1;
            if hops > MAX_FORWARDED_HOPS {
                return peer;
            }
            let Some(ip) = parse_forwarded_entry(entry) else {
                return if hops == 1 { peer } else { client };
            };
            client = ip;
            if !trusted.contains(ip) {
                return ip;
            }
        }
    }
    client
}

/// One `X-Forwarded-For` entry: `1.2.3.4`, `1.2.3.4:567`, `::1` or `[::1]:567`.
fn parse_forwarded_entry(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    entry
        .parse::<SocketAddr>()
        .ok()
        .map(|sa| sa.ip().to_canonical())
}

/// Values of the named parameters of `pattern` (`/bookings/{bookingId}`) in `path`, for
/// services without axum's router. Wildcards (`{*rest}`) take the rest of the path. `None` when
/// the path does not match the pattern.
pub(crate) fn match_pattern(pattern: &str, path: &str) -> Option<Vec<(String, ParamValue)>> {
    let mut params = Vec::new();
    let mut pat = pattern.trim_start_matches('/').split('/');
    let mut segs = path.trim_start_matches('/').split('/');
    let decoded = |name: &str, raw: &str| {
        percent_decode(raw).ok_or_else(|| MalformedId::PathNotUtf8 {
            name: Some(name.to_owned()),
        })
    };
    loop {
        match (pat.next(), segs.next()) {
            (None, None) => return Some(params),
            (Some(p), Some(s)) => {
                if let Some(name) = p.strip_prefix("{*").and_then(|p| p.strip_suffix('}')) {
                    let mut rest = s.to_owned();
                    for s in segs.by_ref() {
                        rest.push('/');
                        rest.push_str(s);
                    }
                    params.push((name.to_owned(), decoded(name, &rest)));
                    return Some(params);
                }
                if let Some(name) = p.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                    if s.is_empty() {
                        return None;
                    }
                    params.push((name.to_owned(), decoded(name, s)));
                } else if p != s {
                    return None;
                }
            }
            _ => return None,
        }
    }
}

/// Decodes `%XX` escapes; invalid escapes stay as written. `None` when the result is not
/// UTF-8: decoding it lossily would give different ids the same U+FFFD.
pub(crate) fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// Whether every key made from `made` has the shape the store takes (not empty, not too long,
/// not the reserved first character): `made` itself for a whole-route limit; for an entity limit
/// each `made` and an id that `check::hashed_key` keeps, the longest of which is `made` and an id's
/// digest.
pub(crate) fn made_keys_fit(made: &str, entity: bool) -> bool {
    let longest = if entity {
        made.len() + HASHED.len() + 2 * DIGEST_BYTES
    } else {
        made.len()
    };
    crate::key::validate_key_shape(made).is_ok() && longest <= crate::key::MAX_KEY_BYTES
}

/// The bytes of a SHA-256 digest, written in `check::hashed_key` as twice as many hex digits.
pub(crate) const DIGEST_BYTES: usize = 32;

/// What marks a hashed id in an entity key (`check::hashed_key`).
pub(crate) const HASHED: &str = "sha256:";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_matches_by_prefix() {
        let t = TrustedProxies::parse(["10.0.0.0/8", "192.168.1.7", "fd00::/8"]).unwrap();
        assert!(t.contains("10.1.2.3".parse().unwrap()));
        assert!(t.contains("192.168.1.7".parse().unwrap()));
        assert!(!t.contains("192.168.1.8".parse().unwrap()));
        assert!(t.contains("fd12::1".parse().unwrap()));
        assert!(t.contains("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!t.contains("11.0.0.1".parse().unwrap()));
        let all = TrustedProxies::parse(["0.0.0.0/0"]).unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        assert!(TrustedProxies::parse(["10.0.0.0/33"]).is_err());
        assert!(TrustedProxies::parse(["nope"]).is_err());
    }

    #[test]
    fn pattern_matching_finds_params() {
        let p = match_pattern("/bookings/{bookingId}/automate", "/bookings/a%20b/automate");
        assert_eq!(p, Some(vec![("bookingId".into(), Ok("a b".into()))]));
        assert_eq!(match_pattern("/bookings/{id}", "/bookings/"), None);
        assert_eq!(match_pattern("/bookings/{id}", "/other/1"), None);
        assert_eq!(
            match_pattern("/files/{*path}", "/files/a/b"),
            Some(vec![("path".into(), Ok("a/b".into()))])
        );
        assert_eq!(percent_decode("%4").as_deref(), Some("%4"));
        assert_eq!(percent_decode("%zz%41").as_deref(), Some("%zzA"));
        assert_eq!(percent_decode("%C3%A9").as_deref(), Some("é"));
        assert_eq!(percent_decode("%FF"), None);
        assert_eq!(percent_decode("%FE"), None);
        assert_eq!(
            match_pattern("/bookings/{id}", "/bookings/%FF"),
            Some(vec![(
                "id".into(),
                Err(MalformedId::PathNotUtf8 {
                    name: Some("id".into())
                })
            )])
        );
    }
}
