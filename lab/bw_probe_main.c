/* lab/bw_probe_main.c: entry point of bw_probe (the probe itself is bw_probe.cu). */
int bw_probe_main(int argc, char **argv);

int main(int argc, char **argv) { return bw_probe_main(argc, argv); }
