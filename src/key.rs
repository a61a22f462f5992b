//! Keys: what a key may be ([`validate_key`] and the [`KeyError`] that says why not), and
//! [`SlotKey`], a copy of a key in place when short and on the heap when not (the lease
//! table's slots and `MemoryStore`'s buckets keep their keys so). The public items are
//! re-exported from [`crate::error`].

/// The longest key in bytes. PostgreSQL refuses btree index entries above 2704 bytes; the rest
/// of the limit leaves room for the row header and prefixes that the HTTP layer adds.
pub const MAX_KEY_BYTES: usize = 1024;

/// Why a key was refused before it reached the store.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is the empty string.
    #[error("invalid key: the key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_BYTES`].
    #[error("invalid key: {len} bytes is longer than the limit of {MAX_KEY_BYTES} bytes")]
    TooLong {
        /// The key's length in bytes.
        len: usize,
    },
    /// The key holds a NUL byte, which PostgreSQL text cannot store.
    #[error("invalid key: NUL byte at offset {offset}")]
    Nul {
        /// Byte offset of the first NUL.
        offset: usize,
    },
    /// The key (given as bytes) is not valid UTF-8.
    #[error("invalid key: not UTF-8 at byte offset {offset}")]
    NotUtf8 {
        /// Byte offset where the invalid sequence starts.
        offset: usize,
    },
    /// The key starts with U+0001 ([`RESERVED_KEY_PREFIX`]), which marks the buckets a shadow
    /// plan keeps under keys of its own ([`Plan::store_key`](crate::policy::Plan::store_key)).
    #[error("invalid key: a key starting with U+0001 is reserved for the buckets of shadow plans")]
    Reserved,
}

/// The first character of every key under which a shadow plan keeps its bucket
/// ([`Plan::store_key`](crate::policy::Plan::store_key)), and of no key a caller may use:
/// [`validate_key`] refuses it, so a shadow plan's bucket never shares a row with a caller's
/// key.
pub const RESERVED_KEY_PREFIX: char = '\u{1}';

/// The longest key the limiter sends to the store: [`MAX_KEY_BYTES`] and what a shadow plan's
/// key adds (`Plan::store_key`: U+0001, `shadow:`, at most 64 bytes of plan name and a colon).
pub(crate) const MAX_STORED_KEY_BYTES: usize = MAX_KEY_BYTES + 73;

/// Checks a key for the store: non-empty, at most [`MAX_KEY_BYTES`] bytes, no NUL, not
/// starting with [`RESERVED_KEY_PREFIX`].
///
/// # Errors
///
/// The first [`KeyError`] that applies.
pub fn validate_key(key: &str) -> Result<(), KeyError> {
    validate_key_shape(key)?;
    validate_stored_key(key)
}

/// [`validate_key`] but for the scan for NUL bytes: for a key made of bytes that cannot hold
/// one (the HTTP layer's entity key of a path segment as the client sent it, which the URI
/// parser admitted).
pub(crate) fn validate_key_shape(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong { len: key.len() });
    }
    if key.starts_with(RESERVED_KEY_PREFIX) {
        return Err(KeyError::Reserved);
    }
    Ok(())
}

/// Checks a key the limiter itself sends to the store: a caller's key that passed
/// [`validate_key`], or a shadow plan's key made from one, which starts with
/// [`RESERVED_KEY_PREFIX`] and may be up to [`MAX_STORED_KEY_BYTES`] long.
pub(crate) fn validate_stored_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_STORED_KEY_BYTES {
        return Err(KeyError::TooLong { len: key.len() });
    }
    // `contains` on bytes scans a word at a time (the HTTP layer checks every entity key).
    if key.as_bytes().contains(&0)
        && let Some(offset) = key.bytes().position(|b| b == 0)
    {
        return Err(KeyError::Nul { offset });
    }
    Ok(())
}

/// Checks a key given as bytes: valid UTF-8, then as [`validate_key`].
///
/// # Errors
///
/// The first [`KeyError`] that applies.
pub fn validate_key_bytes(key: &[u8]) -> Result<&str, KeyError> {
    let key = std::str::from_utf8(key).map_err(|e| KeyError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    validate_key(key)?;
    Ok(key)
}

/// Key bytes held in the slot itself: with the length and the tag, 24 bytes, the size of the
/// `Arc<str>` it replaced plus a word (`docs/design/memory.md`).
const INLINE: usize = 22;

/// A copy of a key. A key of at most [`INLINE`] bytes (most keys: `customer:1234567` is 16)
/// costs no allocation of its own; a longer one is one `Box<str>`. It compares and hashes as
/// the `str` it holds, so a map keyed by it is looked up with a `&str`.
#[derive(Clone)]
pub(crate) enum SlotKey {
    /// The key's bytes, zero-padded, and their count.
    Inline(u8, [u8; INLINE]),
    /// A longer key.
    Heap(Box<str>),
}

impl SlotKey {
    /// A copy of `key`.
    pub(crate) fn new(key: &str) -> SlotKey {
        let bytes = key.as_bytes();
        match u8::try_from(bytes.len()) {
            Ok(len) if bytes.len() <= INLINE => {
                let mut inline = [0; INLINE];
                inline[..bytes.len()].copy_from_slice(bytes);
                SlotKey::Inline(len, inline)
            }
            _ => SlotKey::Heap(key.into()),
        }
    }
}

impl std::ops::Deref for SlotKey {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            SlotKey::Inline(len, bytes) => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).expect("a copy of a whole str")
            }
            SlotKey::Heap(key) => key,
        }
    }
}

impl std::borrow::Borrow<str> for SlotKey {
    fn borrow(&self) -> &str {
        self
    }
}

impl PartialEq for SlotKey {
    fn eq(&self, other: &SlotKey) -> bool {
        **self == **other
    }
}

impl Eq for SlotKey {}

impl std::hash::Hash for SlotKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (**self).hash(state);
    }
}

impl std::fmt::Debug for SlotKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys round-trip at every length around the inline limit, multi-byte ones too, and the
    /// key is 24 bytes.
    #[test]
    fn keys_round_trip_inline_and_on_the_heap() {
        assert_eq!(size_of::<SlotKey>(), 24);
        for n in 0..=INLINE + 2 {
            let key = "k".repeat(n);
            let copy = SlotKey::new(&key);
            assert_eq!(&*copy, key);
            assert_eq!(matches!(copy, SlotKey::Inline(..)), n <= INLINE, "{n}");
        }
        let wide = "é".repeat(11);
        assert_eq!(wide.len(), 22);
        assert_eq!(&*SlotKey::new(&wide), wide);
        assert_eq!(&*SlotKey::new(&"é".repeat(12)), "é".repeat(12));
        // Hashes as its `str`, so a map keyed by it finds a `&str`.
        let mut map = std::collections::HashMap::new();
        map.insert(SlotKey::new("short"), 1);
        map.insert(SlotKey::new(&"long".repeat(10)), 2);
        assert_eq!(map.get("short"), Some(&1));
        assert_eq!(map.get("long".repeat(10).as_str()), Some(&2));
        assert_eq!(map.get("shorter"), None);
    }
}
