/* lab/fp8_probe_main.c: entry point of fp8_probe (the probe itself is fp8_probe.cu). */
int fp8_probe_main(int argc, char **argv);

int main(int argc, char **argv) { return fp8_probe_main(argc, argv); }
