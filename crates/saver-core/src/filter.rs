//! Filters: closures that decide which blocks and which rows a save writes.
//!
//! A *block filter* sees one output tensor before any byte is produced (a table's ids, one slot of a
//! table, or a dense tensor, with the shard it belongs to) and keeps or drops it. A *row filter* sees
//! one row of a table (its id and every slot value) and keeps or drops it. Any number of each may be
//! given; a block or row is written only if every filter keeps it.
//!
//! Whatever the filters decide, the saved table stays consistent: dropping a table's ids block drops
//! that whole partition (no slot is ever written without its ids), a dropped row disappears from the
//! ids and from every slot alike, and filtering everything away yields a valid, empty checkpoint.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use globset::{Glob, GlobMatcher};

use crate::error::{Error, Result};
use crate::table::RowView;

/// What kind of output tensor a block filter is looking at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// The ids of a table partition. Dropping it drops the whole partition.
    Ids,
    /// One slot of a table partition.
    Slot,
    /// A dense tensor.
    Dense,
}

/// What a block filter sees.
#[derive(Clone, Copy, Debug)]
pub struct BlockInfo<'a> {
    /// The block's kind.
    pub kind: BlockKind,
    /// The table, for ids and slot blocks.
    pub table: Option<&'a str>,
    /// The slot, for slot blocks.
    pub slot: Option<&'a str>,
    /// The dense tensor's name, for dense blocks.
    pub dense: Option<&'a str>,
    /// The shard the block is written to.
    pub shard: u32,
}

/// A block filter: keep (`true`) or drop the block.
pub type BlockFilterFn = dyn Fn(&BlockInfo<'_>) -> bool + Send + Sync;
/// A row filter: keep (`true`) or drop the row.
pub type RowFilterFn = dyn Fn(&RowView<'_>) -> bool + Send + Sync;

/// An ordered set of block and row filters. Cheap to clone.
#[derive(Clone, Default)]
pub struct Filters {
    blocks: Vec<Arc<BlockFilterFn>>,
    rows: Vec<Arc<RowFilterFn>>,
}

impl fmt::Debug for Filters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Filters")
            .field("block_filters", &self.blocks.len())
            .field("row_filters", &self.rows.len())
            .finish()
    }
}

fn glob(pattern: &str) -> Result<GlobMatcher> {
    Glob::new(pattern)
        .map(|g| g.compile_matcher())
        .map_err(|e| Error::Glob {
            pattern: pattern.to_string(),
            message: e.kind().to_string(),
        })
}

impl Filters {
    /// No filters: everything is kept.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a block filter.
    pub fn keep_blocks(
        mut self,
        f: impl Fn(&BlockInfo<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.blocks.push(Arc::new(f));
        self
    }

    /// Adds a row filter.
    ///
    /// Row filters run during planning, on several threads at once (one per part of a table
    /// being scanned), and a table may hold a lock over the part being scanned while they run
    /// ([`crate::EmbeddingTable`] holds its shard's read lock): a filter must not write to the
    /// table it filters.
    pub fn keep_rows(mut self, f: impl Fn(&RowView<'_>) -> bool + Send + Sync + 'static) -> Self {
        self.rows.push(Arc::new(f));
        self
    }

    /// Drops every slot whose name matches the glob (e.g. `adagrad*` for a serving export). Ids and
    /// dense tensors are unaffected.
    pub fn exclude_slots(self, pattern: &str) -> Result<Self> {
        let m = glob(pattern)?;
        Ok(self.keep_blocks(move |b| {
            !(b.kind == BlockKind::Slot && b.slot.is_some_and(|s| m.is_match(s)))
        }))
    }

    /// Keeps only the tables whose name matches the glob. Dense tensors are unaffected.
    pub fn keep_tables(self, pattern: &str) -> Result<Self> {
        let m = glob(pattern)?;
        Ok(self.keep_blocks(move |b| {
            b.kind == BlockKind::Dense || b.table.is_some_and(|t| m.is_match(t))
        }))
    }

    /// Keeps only the dense tensors whose name matches the glob. Tables are unaffected.
    pub fn keep_dense(self, pattern: &str) -> Result<Self> {
        let m = glob(pattern)?;
        Ok(self.keep_blocks(move |b| {
            b.kind != BlockKind::Dense || b.dense.is_some_and(|d| m.is_match(d))
        }))
    }

    /// Keeps a row only if the condition on one of its scalar slots holds (e.g. `freq >= 5`).
    /// Rows of tables without that slot are kept.
    pub fn keep_rows_where(self, cond: ScalarCondition) -> Self {
        self.keep_rows(move |row| match row.scalar(&cond.slot) {
            Some(v) => cond.holds(v),
            None => row.slot_bytes(&cond.slot).is_none(),
        })
    }

    /// Whether every block filter keeps the block.
    #[doc(hidden)]
    pub fn keep_block(&self, info: &BlockInfo<'_>) -> bool {
        self.blocks.iter().all(|f| f(info))
    }

    /// Whether every row filter keeps the row.
    #[doc(hidden)]
    pub fn keep_row(&self, row: &RowView<'_>) -> bool {
        self.rows.iter().all(|f| f(row))
    }

    /// Whether any row filter is set (planning then reads slot values, otherwise only ids).
    #[doc(hidden)]
    pub fn has_row_filters(&self) -> bool {
        !self.rows.is_empty()
    }
}

/// A comparison operator of a [`ScalarCondition`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Comparison {
    /// `>=`
    Ge,
    /// `>`
    Gt,
    /// `<=`
    Le,
    /// `<`
    Lt,
    /// `==`
    Eq,
    /// `!=`
    Ne,
}

/// A condition on a scalar slot, written `SLOT>=VALUE` (also `>`, `<=`, `<`, `==`, `!=`).
#[derive(Clone, Debug, PartialEq)]
pub struct ScalarCondition {
    /// The slot compared.
    pub slot: String,
    /// The operator.
    pub op: Comparison,
    /// The value compared with.
    pub value: f64,
}

impl ScalarCondition {
    /// Whether `v` satisfies the condition.
    pub(crate) fn holds(&self, v: f64) -> bool {
        match self.op {
            Comparison::Ge => v >= self.value,
            Comparison::Gt => v > self.value,
            Comparison::Le => v <= self.value,
            Comparison::Lt => v < self.value,
            Comparison::Eq => v == self.value,
            Comparison::Ne => v != self.value,
        }
    }
}

impl FromStr for ScalarCondition {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        const OPS: [(&str, Comparison); 6] = [
            (">=", Comparison::Ge),
            ("<=", Comparison::Le),
            ("==", Comparison::Eq),
            ("!=", Comparison::Ne),
            (">", Comparison::Gt),
            ("<", Comparison::Lt),
        ];
        let bad = |why: &str| Error::InvalidOption {
            option: "row condition",
            why: format!("{s:?}: {why} (expected SLOT>=VALUE, with >=, >, <=, <, == or !=)"),
        };
        let (pos, len, op) = OPS
            .iter()
            .filter_map(|(tok, op)| s.find(tok).map(|p| (p, tok.len(), *op)))
            .min_by_key(|(p, len, _)| (*p, usize::MAX - len))
            .ok_or_else(|| bad("no comparison operator"))?;
        let slot = s[..pos].trim();
        let value = s[pos + len..].trim();
        if slot.is_empty() {
            return Err(bad("no slot name"));
        }
        if slot.contains(['<', '>', '=', '!']) {
            return Err(bad("the slot name contains a comparison character"));
        }
        let value: f64 = value
            .parse()
            .map_err(|_| bad("the value is not a number"))?;
        // Every comparison with NaN is false (but !=): such a filter would silently keep
        // nothing, or everything.
        if value.is_nan() {
            return Err(bad("the value is NaN, which no row compares with"));
        }
        Ok(Self {
            slot: slot.to_string(),
            op,
            value,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{Dtype, KeyDtype};
    use crate::table::SlotSpec;

    fn info<'a>(
        kind: BlockKind,
        table: Option<&'a str>,
        slot: Option<&'a str>,
        dense: Option<&'a str>,
    ) -> BlockInfo<'a> {
        BlockInfo {
            kind,
            table,
            slot,
            dense,
            shard: 0,
        }
    }

    #[test]
    fn slot_and_table_globs() {
        let f = Filters::new()
            .exclude_slots("adagrad*")
            .unwrap()
            .keep_tables("user_*")
            .unwrap();
        assert!(f.keep_block(&info(BlockKind::Ids, Some("user_a"), None, None)));
        assert!(f.keep_block(&info(
            BlockKind::Slot,
            Some("user_a"),
            Some("embedding"),
            None
        )));
        assert!(!f.keep_block(&info(
            BlockKind::Slot,
            Some("user_a"),
            Some("adagrad_acc"),
            None
        )));
        assert!(!f.keep_block(&info(BlockKind::Ids, Some("item"), None, None)));
        assert!(f.keep_block(&info(BlockKind::Dense, None, None, Some("mlp.w"))));
        let f = Filters::new().keep_dense("mlp.*").unwrap();
        assert!(!f.keep_block(&info(BlockKind::Dense, None, None, Some("other"))));
        assert!(f.keep_block(&info(BlockKind::Ids, Some("t"), None, None)));
        assert!(Filters::new()
            .exclude_slots("[")
            .unwrap_err()
            .to_string()
            .contains("\"[\""));
    }

    #[test]
    fn conditions_parse_and_hold() {
        let c: ScalarCondition = "freq>=5".parse().unwrap();
        assert_eq!(
            (c.slot.as_str(), c.op, c.value),
            ("freq", Comparison::Ge, 5.0)
        );
        assert!(c.holds(5.0) && !c.holds(4.9));
        let c: ScalarCondition = " step > 10 ".parse().unwrap();
        assert_eq!(c.op, Comparison::Gt);
        assert_eq!("a<3".parse::<ScalarCondition>().unwrap().op, Comparison::Lt);
        assert_eq!(
            "a!=3".parse::<ScalarCondition>().unwrap().op,
            Comparison::Ne
        );
        for bad in [
            "freq",
            ">=5",
            "freq>=x",
            "",
            "freq=>3",
            "a<>3",
            "freq>=nan",
            "freq<NaN",
        ] {
            let e = bad.parse::<ScalarCondition>().unwrap_err().to_string();
            assert!(e.contains("SLOT>=VALUE"), "{bad}: {e}");
        }
        let e = "freq>=nan"
            .parse::<ScalarCondition>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("NaN"), "{e}");
    }

    #[test]
    fn row_condition_on_scalar_slot() {
        let specs = [
            SlotSpec::new("freq", Dtype::I64, vec![]),
            SlotSpec::new("e", Dtype::F32, vec![2]),
        ];
        let f = Filters::new().keep_rows_where("freq>=3".parse().unwrap());
        let e = [0u8; 8];
        let hot = 3i64.to_le_bytes();
        let cold = 2i64.to_le_bytes();
        let row = |v: &'static [u8; 8]| {
            let vals: Vec<&[u8]> = vec![v, &e];
            f.keep_row(&RowView::new("t", KeyDtype::I64, 1, &specs, &vals))
        };
        let hot: &'static [u8; 8] = Box::leak(Box::new(hot));
        let cold: &'static [u8; 8] = Box::leak(Box::new(cold));
        assert!(row(hot));
        assert!(!row(cold));
        // A table without the slot keeps its rows.
        let specs2 = [SlotSpec::new("e", Dtype::F32, vec![2])];
        let vals: Vec<&[u8]> = vec![&e];
        assert!(f.keep_row(&RowView::new("u", KeyDtype::I64, 1, &specs2, &vals)));
    }
}
