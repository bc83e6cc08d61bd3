//! What every table is apart from its rows: [`TableSchema`].

use crate::dtype::KeyDtype;
use crate::error::Result;
use crate::table::SlotSpec;

/// A table's name, key dtype and slots: what [`crate::SparseTable::schema`] returns, one value
/// for every kind of table (in memory, in arrays, read from a checkpoint, a chain or plain files).
#[derive(Clone, Debug, PartialEq)]
pub struct TableSchema {
    /// The table's name; unique within a model. No `/`, `:` or control characters.
    pub name: String,
    /// Whether ids are signed or unsigned.
    pub key_dtype: KeyDtype,
    /// The slots every row has, in a fixed order.
    pub slots: Vec<SlotSpec>,
}

impl TableSchema {
    /// The schema of table `name`.
    pub fn new(name: impl Into<String>, key_dtype: KeyDtype, slots: Vec<SlotSpec>) -> Self {
        Self {
            name: name.into(),
            key_dtype,
            slots,
        }
    }

    /// Bytes of one row of each slot, in slot order.
    pub fn row_bytes(&self) -> Result<Vec<u64>> {
        self.slots.iter().map(SlotSpec::row_bytes).collect()
    }
}
