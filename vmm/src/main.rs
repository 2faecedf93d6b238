//! The `tandem` program: everything it does is in `vmm::cli`.

fn main() -> std::process::ExitCode {
    vmm::cli::main()
}
