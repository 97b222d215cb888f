/* MPI_IN_PLACE is a macro whose value differs between MPI implementations ((void *) 1 in
   Open MPI, (void *) -1 in MPICH) and that mpi-sys does not export: this returns the value of
   the MPI the crate is built against. */
#include <mpi.h>

void *comm_mpi_in_place(void) { return MPI_IN_PLACE; }
