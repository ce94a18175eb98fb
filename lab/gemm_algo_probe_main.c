/* lab/gemm_algo_probe_main.c: entry point of gemm_algo_probe (the probe is gemm_algo_probe.cu). */
int gemm_algo_probe_main(int argc, char **argv);

int main(int argc, char **argv) { return gemm_algo_probe_main(argc, argv); }
