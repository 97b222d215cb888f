//! The `commrun` binary: see the crate documentation of the `commrun` library.

fn main() {
    let opts = commrun::cli::parse();
    std::process::exit(commrun::launch::run(&opts));
}
