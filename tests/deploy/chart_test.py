"""The Helm chart charts/metrale, checked without a cluster.

Helm's own engine (helm-python-sdk: the Helm Go SDK behind a C ABI, offline) lints the chart and
renders it for the default values and every value set in charts/metrale/examples/; every
rendered object is validated against the Kubernetes 1.30 JSON schemas (kubernetes-validate,
strict: unknown fields fail); the pods are checked for what the chart promises (one container
running metrale-serve with GPUs = tp, gRPC probes, a read-only root filesystem, the drain
budget, the metrics port and its ServiceMonitor, with TLS the Secrets mounted, the options given
and the probes on the plaintext health port...); the rendered metrale-serve arguments are given to
the real metrale-serve, which must accept them; invalid values must be refused, by the schema or
by the templates; and the chart's appVersion is the version the router reports (MT_VERSION).

Run through tests/deploy/pytools.sh (bazel test //tests/deploy:chart_test).
"""

import glob
import os
import re
import subprocess
import unittest

import helm_python as helm
import kubernetes_validate
import yaml

CHART = "charts/metrale"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "metrale-test", "ml"
SERVE_BIN = "launcher/metrale-serve"
MT_H = "common/mt.h"
# Objects of CRDs, which the Kubernetes schemas do not know; check_objects checks them.
CRD_KINDS = {"ServiceMonitor"}
GRPC_HEALTH_SERVICES = {"startupProbe": "", "livenessProbe": "", "readinessProbe": "metrale.v1.Generation"}


def path(rel):
    """A runfile, or its bazel-bin twin when run from the workspace root."""
    if os.path.exists(rel):
        return rel
    alt = os.path.join("bazel-bin", rel)
    if os.path.exists(alt):
        return alt
    raise FileNotFoundError(rel + " (not in the runfiles nor in bazel-bin/)")


def cases():
    """(name, values) for the default values and each example value set."""
    out = [("defaults", {})]
    for fn in sorted(glob.glob(os.path.join(CHART, "examples", "*.yaml"))):
        with open(fn) as f:
            out.append((os.path.basename(fn), yaml.safe_load(f) or {}))
    return out


def render(values):
    """The rendered objects (dicts), NOTES.txt left out."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objs = []
    for name, text in sorted(manifests.items()):
        if name.endswith("NOTES.txt"):
            continue
        objs += [d for d in yaml.safe_load_all(text) if d]
    return objs


def merged(values):
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def arg(args, flag):
    """The value after flag in args, or None."""
    return args[args.index(flag) + 1] if flag in args else None


class ChartTest(unittest.TestCase):
    def test_lint(self):
        for name, values in cases():
            with self.subTest(case=name):
                report = helm.lint(CHART, values, strict=True, kube_version="v" + KUBE_VERSION)
                self.assertEqual(report["errors"], [])
                # severity 1 is information ("icon is recommended"); 2 warning, 3 error
                serious = [m for m in report["messages"] if m["severity"] >= 2]
                self.assertEqual(serious, [])

    def test_rendered_objects_match_the_kubernetes_schemas(self):
        for name, values in cases():
            with self.subTest(case=name):
                objs = render(values)
                self.assertGreaterEqual(len(objs), 2)
                for o in objs:
                    if o["kind"] in CRD_KINDS:
                        continue
                    try:
                        kubernetes_validate.validate(o, KUBE_VERSION, strict=True)
                    except kubernetes_validate.ValidationError as e:
                        self.fail("%s %s: %s at %s" % (o["kind"], o["metadata"]["name"], e.message,
                                                       "/".join(str(p) for p in e.path)))

    def test_objects_do_what_the_chart_says(self):
        for name, values in cases():
            with self.subTest(case=name):
                self.check_objects(render(values), merged(values))

    def check_objects(self, objs, v):
        (dep,) = by_kind(objs, "Deployment")
        fullname = dep["metadata"]["name"]
        spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
        self.assertEqual(spec["selector"]["matchLabels"],
                         {k: dep["spec"]["template"]["metadata"]["labels"][k] for k in spec["selector"]["matchLabels"]})

        # one pod per group; the HPA owns the count when autoscaling is on
        hpas = by_kind(objs, "HorizontalPodAutoscaler")
        if v["autoscaling"]["enabled"]:
            self.assertNotIn("replicas", spec)
            self.assertEqual(len(hpas), 1)
            self.assertEqual(hpas[0]["spec"]["scaleTargetRef"], {"apiVersion": "apps/v1", "kind": "Deployment",
                                                                 "name": fullname})
            av = v["autoscaling"]
            metric = hpas[0]["spec"]["metrics"]
            if av["metrics"]:
                self.assertEqual(metric, av["metrics"])
            elif av.get("targetWaitingRequests") is not None:
                self.assertEqual(metric, [{"type": "Pods", "pods": {
                    "metric": {"name": "metrale_num_requests_waiting"},
                    "target": {"type": "AverageValue", "averageValue": str(av["targetWaitingRequests"])}}}])
            else:
                self.assertEqual(metric[0]["resource"]["name"], "cpu")
        else:
            self.assertEqual(spec["replicas"], v["groups"])
            self.assertEqual(hpas, [])
        self.assertEqual(spec["strategy"]["type"], "RollingUpdate")

        # the router and the group's workers in one container
        (c,) = pod["containers"]
        self.assertEqual(c["command"], ["/opt/metrale/bin/metrale-serve"])
        args = c["args"]
        self.assertEqual(arg(args, "--workers"), "1")
        self.assertEqual(arg(args, "--tp"), str(v["tp"]) if v["tp"] > 1 else None)
        self.assertEqual(arg(args, "--backend"), v["backend"])
        self.assertEqual(arg(args, "--listen"), "0.0.0.0:%d" % v["serve"]["port"])
        self.assertEqual(float(arg(args, "--drain-timeout")), v["serve"]["drainTimeoutSeconds"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        mv = v["metrics"]
        tls = v["tls"]["enabled"]
        want_ports = {"grpc": v["serve"]["port"]}
        if mv["enabled"]:
            want_ports["metrics"] = mv["port"]
        if tls:
            want_ports["health"] = v["serve"]["healthPort"]
        self.assertEqual(ports, want_ports)
        self.assertEqual(arg(args, "--metrics"), "0.0.0.0:%d" % mv["port"] if mv["enabled"] else None)
        ann = dep["spec"]["template"]["metadata"].get("annotations", {})
        if mv["enabled"] and mv["podAnnotations"]:
            want_ann = {"prometheus.io/scrape": "true", "prometheus.io/port": str(mv["port"]),
                        "prometheus.io/path": "/metrics"}
            want_ann.update(v["podAnnotations"])
            self.assertEqual(ann, want_ann)
        else:
            self.assertEqual(ann, v["podAnnotations"])

        # GPUs: tp of them in requests and limits on the cuda backend, none on the cpu backend
        gpu = v["gpu"]["resourceName"]
        res = c.get("resources", {})
        if v["backend"] == "cuda":
            self.assertEqual(res["requests"][gpu], v["tp"])
            self.assertEqual(res["limits"][gpu], v["tp"])
        else:
            self.assertNotIn(gpu, res.get("requests", {}))
            self.assertNotIn(gpu, res.get("limits", {}))
            cpu_limit = res.get("limits", {}).get("cpu")
            if cpu_limit is not None and v["serve"]["threads"] == 0:
                cores = int(cpu_limit[:-1]) // 1000 if str(cpu_limit).endswith("m") else int(float(cpu_limit))
                self.assertEqual(arg(args, "--threads"), str(max(1, cores // v["tp"])))

        # gRPC probes on the serving port, or with TLS on the plaintext health-only port (the
        # kubelet's probes speak neither TLS nor tokens)
        probe_port = v["serve"]["healthPort"] if tls else v["serve"]["port"]
        for probe, service in GRPC_HEALTH_SERVICES.items():
            self.assertEqual(c[probe]["grpc"], {"port": probe_port, "service": service}, probe)
        startup = c["startupProbe"]
        self.assertEqual(startup["periodSeconds"] * startup["failureThreshold"],
                         v["probes"]["startup"]["periodSeconds"] * v["probes"]["startup"]["failureThreshold"])

        # the drain fits in the grace period: preStop, --drain-timeout, then the router's and
        # metrale-serve's own waits (3 + 10 + 5 s)
        pre_stop = v["preStopSleepSeconds"]
        self.assertGreater(pod["terminationGracePeriodSeconds"], pre_stop + v["serve"]["drainTimeoutSeconds"] + 18)
        if pre_stop:
            self.assertEqual(c["lifecycle"]["preStop"]["exec"]["command"], ["sleep", str(pre_stop)])
        else:
            self.assertNotIn("lifecycle", c)

        # non-root, read-only root filesystem, no privilege escalation, no capabilities
        self.assertTrue(pod["securityContext"]["runAsNonRoot"])
        self.assertNotEqual(pod["securityContext"]["runAsUser"], 0)
        self.assertFalse(pod["automountServiceAccountToken"])
        for ctr in pod["containers"] + pod.get("initContainers", []):
            sc = ctr["securityContext"]
            self.assertTrue(sc["readOnlyRootFilesystem"], ctr["name"])
            self.assertFalse(sc["allowPrivilegeEscalation"], ctr["name"])
            self.assertEqual(sc["capabilities"]["drop"], ["ALL"], ctr["name"])
            self.assertTrue(sc["runAsNonRoot"], ctr["name"])

        # writable places: /tmp (the ipc socket) and /dev/shm (the group's ranks), both emptyDirs
        vols = {x["name"]: x for x in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        self.assertIn("emptyDir", vols[mounts["/tmp"]["name"]])
        self.assertEqual(vols[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"], "Memory")

        # TLS, mutual TLS and the token: each Secret mounted read-only as a whole folder (no
        # subPath, so a rotated Secret reaches the files), and its file given to metrale-serve
        secrets = {}
        for mount in c["volumeMounts"]:
            secret = vols[mount["name"]].get("secret")
            if secret:
                self.assertTrue(mount.get("readOnly"), mount)
                self.assertNotIn("subPath", mount)
                for item in secret["items"]:
                    secrets[mount["mountPath"] + "/" + item["path"]] = (secret["secretName"], item["key"])
        want = {}
        if tls:
            want[arg(args, "--tls-cert")] = (v["tls"]["secretName"], "tls.crt")
            want[arg(args, "--tls-key")] = (v["tls"]["secretName"], "tls.key")
            self.assertEqual(arg(args, "--health-listen"), "0.0.0.0:%d" % v["serve"]["healthPort"])
        else:
            for flag in ("--tls-cert", "--tls-key", "--tls-client-ca", "--health-listen"):
                self.assertNotIn(flag, args)
        if tls and v["tls"]["clientCA"]["enabled"]:
            want[arg(args, "--tls-client-ca")] = (v["tls"]["clientCA"]["secretName"] or v["tls"]["secretName"],
                                                  v["tls"]["clientCA"]["key"])
        else:
            self.assertNotIn("--tls-client-ca", args)
        if v["auth"]["tokenSecret"]["name"]:
            want[arg(args, "--auth-token-file")] = (v["auth"]["tokenSecret"]["name"], v["auth"]["tokenSecret"]["key"])
        else:
            self.assertNotIn("--auth-token-file", args)
        self.assertEqual(secrets, want)

        # the model
        m, source = v["model"], v["model"]["source"]
        if source == "image":
            self.assertEqual(arg(args, "--model"), m["image"]["path"])
            self.assertNotIn("model", vols)
        else:
            self.assertEqual(arg(args, "--model"), m["mountPath"])
            mount = mounts[m["mountPath"]]
            self.assertTrue(mount["readOnly"])
            self.assertEqual(mount["name"], "model")
            kind = {"pvc": "persistentVolumeClaim", "hostPath": "hostPath", "init": "emptyDir"}[source]
            self.assertIn(kind, vols["model"])
            if source == "pvc":
                self.assertEqual(vols["model"]["persistentVolumeClaim"]["claimName"], m["pvc"]["claimName"])
                self.assertEqual(mount.get("subPath", ""), m["pvc"]["subPath"])
            if source == "init":
                (init,) = pod["initContainers"]
                self.assertEqual(init["volumeMounts"][0], {"name": "model", "mountPath": m["mountPath"]})
                self.assertIn({"name": "METRALE_MODEL_DIR", "value": m["mountPath"]}, init["env"])
        if source != "init":
            self.assertNotIn("initContainers", pod)

        # Services: the gRPC port is named grpc with appProtocol grpc; the headless one on request
        services = {s["metadata"]["name"]: s for s in by_kind(objs, "Service")}
        svc = services.pop(fullname)
        want_port = {"name": "grpc", "port": v["service"]["port"], "targetPort": "grpc", "protocol": "TCP",
                     "appProtocol": "grpc"}
        metrics_port = {"name": "metrics", "port": mv["port"], "targetPort": "metrics", "protocol": "TCP",
                        "appProtocol": "http"}
        self.assertEqual(svc["spec"]["ports"], [want_port] + ([metrics_port] if mv["enabled"] else []))
        self.assertEqual(svc["spec"]["selector"], spec["selector"]["matchLabels"])
        if v["headless"]["enabled"]:
            head = services.pop(fullname + "-headless")
            self.assertEqual(head["spec"]["clusterIP"], "None")
            self.assertEqual(head["spec"]["ports"], [want_port])
        self.assertEqual(services, {})

        # a ServiceMonitor on request: the Service's pods, on its metrics port
        monitors = by_kind(objs, "ServiceMonitor")
        if mv["enabled"] and mv["serviceMonitor"]["enabled"]:
            (sm,) = monitors
            sm_v = mv["serviceMonitor"]
            self.assertEqual(sm["apiVersion"], "monitoring.coreos.com/v1")
            for k, val in sm_v["labels"].items():
                self.assertEqual(sm["metadata"]["labels"][k], val)
            self.assertEqual(sm["spec"]["selector"]["matchLabels"], spec["selector"]["matchLabels"])
            self.assertEqual(sm["spec"]["namespaceSelector"], {"matchNames": [NAMESPACE]})
            (ep,) = sm["spec"]["endpoints"]
            want_ep = {"port": "metrics", "path": "/metrics", "interval": sm_v["interval"]}
            if sm_v["scrapeTimeout"]:
                want_ep["scrapeTimeout"] = sm_v["scrapeTimeout"]
            self.assertEqual(ep, want_ep)
        else:
            self.assertEqual(monitors, [])

        pdbs = by_kind(objs, "PodDisruptionBudget")
        self.assertEqual(len(pdbs), 1 if v["podDisruptionBudget"]["enabled"] else 0)

    def test_metrale_serve_accepts_the_rendered_arguments(self):
        # metrale-serve parses every option before --help and exits 2 at the first it does not
        # know or whose value it refuses; --help then exits 0 without starting anything.
        serve = path(SERVE_BIN)
        for name, values in cases():
            with self.subTest(case=name):
                (dep,) = by_kind(render(values), "Deployment")
                args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
                p = subprocess.run([serve] + args + ["--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   timeout=10)
                self.assertEqual(p.returncode, 0, "metrale-serve %s:\n%s" % (" ".join(args), p.stdout.decode()))

    def test_invalid_values_are_refused(self):
        refused = [
            # by values.schema.json
            ({"tp": 0}, "/tp"),
            ({"tp": 65}, "/tp"),
            ({"tp": "2"}, "/tp"),
            ({"groups": -1}, "/groups"),
            ({"replicas": 2}, "additional properties 'replicas'"),
            ({"serve": {"drainTimeout": 10}}, "additional properties 'drainTimeout'"),
            ({"model": {"source": "s3"}}, "/model/source"),
            ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
            ({"model": {"source": "hostPath", "hostPath": {"path": "models"}}}, "/model/hostPath/path"),
            ({"model": {"source": "init"}}, "/model/init"),
            ({"backend": "rocm"}, "/backend"),
            ({"serve": {"numerics": "fp8"}}, "/serve/numerics"),
            ({"serve": {"port": 0}}, "/serve/port"),
            ({"serve": {"maxSequences": 0}}, "/serve/maxSequences"),
            ({"probes": {"startup": {"periodSeconds": 0}}}, "/probes/startup/periodSeconds"),
            ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
            ({"shm": {"sizeLimit": "lots"}}, "/shm/sizeLimit"),
            ({"metrics": {"port": 0}}, "/metrics/port"),
            ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
            ({"metrics": {"scrape": True}}, "additional properties 'scrape'"),
            ({"tls": {"enabled": True}}, "/tls/secretName"),
            ({"tls": {"enabled": True, "secretName": "Not_A_Name"}}, "/tls/secretName"),
            ({"tls": {"certFile": "x"}}, "additional properties 'certFile'"),
            ({"auth": {"tokenSecret": {"name": "t", "key": "a/b"}}}, "/auth/tokenSecret/key"),
            ({"serve": {"healthPort": 0}}, "/serve/healthPort"),
            # by the templates
            ({"terminationGracePeriodSeconds": 40}, "terminationGracePeriodSeconds 40 is too short"),
            ({"serve": {"drainTimeoutSeconds": 100}, "terminationGracePeriodSeconds": 120}, "too short"),
            ({"podDisruptionBudget": {"minAvailable": 1}}, "not both"),
            ({"tls": {"clientCA": {"enabled": True}}}, "needs tls.enabled"),
            ({"tls": {"enabled": True, "secretName": "s"}, "serve": {"healthPort": 50051}}, "must differ"),
            ({"resources": {"limits": {"nvidia.com/gpu": 2}}}, "is set from tp"),
            ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "is above"),
            ({"autoscaling": {"targetWaitingRequests": 0}}, "/autoscaling/targetWaitingRequests"),
            ({"metrics": {"port": 50051}}, "metrics.port 50051 is serve.port"),
        ]
        for values, why in refused:
            with self.subTest(values=values):
                with self.assertRaises((helm.HelmValuesError, helm.HelmRenderError)) as ctx:
                    render(values)
                self.assertIn(why, str(ctx.exception))

    def test_app_version_is_the_routers(self):
        with open(os.path.join(CHART, "Chart.yaml")) as f:
            app_version = yaml.safe_load(f)["appVersion"]
        with open(path(MT_H)) as f:
            m = re.search(r'#define MT_VERSION "([^"]+)"', f.read())
        self.assertIsNotNone(m, "no MT_VERSION in " + MT_H)
        self.assertEqual(m.group(1), app_version)

    def test_metrics_can_be_turned_off(self):
        values = {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}}
        objs = render(values)
        self.check_objects(objs, merged(values))
        self.assertEqual(by_kind(objs, "ServiceMonitor"), [])

    def test_lint_reports_invalid_values(self):
        report = helm.lint(CHART, {"tp": 0}, strict=True, kube_version="v" + KUBE_VERSION)
        self.assertTrue(any("/tp" in m["error"] for m in report["messages"] if m["severity"] == 3), report)


if __name__ == "__main__":
    unittest.main()
