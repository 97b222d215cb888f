//! Compiles `csrc/in_place.c` (the value of `MPI_IN_PLACE`) against the MPI that mpi-sys finds,
//! the same way mpi-sys builds its own shim.

fn main() {
    println!("cargo:rerun-if-changed=csrc/in_place.c");
    let lib = match build_probe_mpi::probe() {
        Ok(lib) => lib,
        Err(errs) => {
            for e in errs {
                println!("cargo:warning=probing for MPI: {e}");
            }
            panic!("backend-mpi needs an MPI installation (mpicc or pkg-config): none found");
        }
    };
    let mut build = cc::Build::new();
    build.file("csrc/in_place.c");
    match lib.mpicc {
        Some(mpicc) => {
            build.compiler(mpicc);
        }
        None => {
            for inc in &lib.include_paths {
                build.include(inc);
            }
        }
    }
    build.compile("comm_mpi_in_place");
}
