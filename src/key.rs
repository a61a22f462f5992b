//! A copy of a key: in place when short, on the heap when not. The lease table's slots and
//! `MemoryStore`'s buckets keep their keys so.

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
