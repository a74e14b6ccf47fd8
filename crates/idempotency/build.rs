fn main() {
    // sqlx::migrate! embeds the migrations at build time: a new file must rebuild the crate.
    println!("cargo:rerun-if-changed=migrations");
}
