//! The `saver` binary's tests, in one test binary: each module runs the command as a user
//! would and says in its docs what it asserts.

#[path = "../../../../tests/integration/common/garage.rs"]
mod garage;

mod commands;
mod lease;
mod manage;
mod many_hosts;
mod memory;
mod races;
mod s3;
