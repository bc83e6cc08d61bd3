//! saver's integration tests through the public API, in one test binary (one link step, one
//! process whose tests share one object-store server): each module is one concern, its own
//! docs say what it asserts.

mod common;

mod compressed;
mod crash;
mod delta;
mod export_refusals;
mod hostile;
mod import_rounds;
mod load_request;
mod load_reshard;
mod manager;
mod manager_races;
mod object_store;
mod object_store_faults;
mod point_in_time;
mod prelude;
mod races;
mod row_range;
mod row_range_delta;
mod row_range_table;
mod save_commit;
mod streaming;
mod workers;
