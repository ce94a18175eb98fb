{{/* Names and labels. */}}
{{- define "metrale.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "metrale.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "metrale.selectorLabels" -}}
app.kubernetes.io/name: {{ include "metrale.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "metrale.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "metrale.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: server
{{- end }}

{{- define "metrale.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "metrale.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "metrale.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The checkpoint folder metrale-serve is given (--model). */}}
{{- define "metrale.modelDir" -}}
{{- if eq .Values.model.source "image" }}
{{- .Values.model.image.path }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/*
--threads for each worker process: serve.threads when set; else, on the cpu backend, the
container's CPU limit in whole cores shared by the tp ranks (at least 1 each); else 0, which
leaves it to metrale-serve (it shares the node's cores, which a container may not own).
*/}}
{{- define "metrale.threads" -}}
{{- $t := int .Values.serve.threads }}
{{- if and (eq $t 0) (eq .Values.backend "cpu") }}
{{- $cpu := toString (dig "limits" "cpu" "" .Values.resources) }}
{{- if $cpu }}
{{- $cores := 0 }}
{{- if hasSuffix "m" $cpu }}
{{- $cores = div (int (trimSuffix "m" $cpu)) 1000 }}
{{- else }}
{{- $cores = int (floor (float64 $cpu)) }}
{{- end }}
{{- $t = max 1 (div $cores (int .Values.tp)) }}
{{- end }}
{{- end }}
{{- $t }}
{{- end }}

{{/*
Seconds from SIGTERM until every process has exited, at most: the preStop sleep, the router's
drain (--drain-timeout), its wait for the workers to leave (3 s, router/router.c), metrale-serve's
wait for workers that outlive the router (10 s) and its SIGTERM-to-SIGKILL step (5 s)
(launcher/serve.c), rounded up to 20 s. The computed grace period adds 10 s to that.
*/}}
{{- define "metrale.shutdownSeconds" -}}
{{- add (int .Values.preStopSleepSeconds) (int (ceil (float64 .Values.serve.drainTimeoutSeconds))) 20 }}
{{- end }}

{{- define "metrale.terminationGracePeriodSeconds" -}}
{{- $need := int (include "metrale.shutdownSeconds" .) }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $need 10 }}
{{- else }}
{{- $set := int .Values.terminationGracePeriodSeconds }}
{{- if lt $set $need }}
{{- fail (printf "terminationGracePeriodSeconds %d is too short: the drain and shutdown take up to %d s (preStopSleepSeconds %v + serve.drainTimeoutSeconds %v + 20)" $set $need .Values.preStopSleepSeconds .Values.serve.drainTimeoutSeconds) }}
{{- end }}
{{- $set }}
{{- end }}
{{- end }}

{{/* metrale-serve's arguments; every one is an option metrale-serve has. */}}
{{- define "metrale.args" -}}
{{- $s := .Values.serve -}}
- --listen
- {{ printf "0.0.0.0:%d" (int $s.port) | quote }}
- --workers
- "1"
{{- if gt (int .Values.tp) 1 }}
- --tp
- {{ int .Values.tp | quote }}
{{- end }}
- --backend
- {{ .Values.backend | quote }}
- --model
- {{ include "metrale.modelDir" . | quote }}
- --drain-timeout
- {{ $s.drainTimeoutSeconds | quote }}
- --max-sequences
- {{ int $s.maxSequences | quote }}
- --max-context
- {{ int $s.maxContext | quote }}
{{- $threads := int (include "metrale.threads" .) }}
{{- if gt $threads 0 }}
- --threads
- {{ $threads | quote }}
{{- end }}
{{- if not (kindIs "invalid" $s.queue) }}
- --queue
- {{ int $s.queue | quote }}
{{- end }}
{{- if $s.numerics }}
- --numerics
- {{ $s.numerics | quote }}
{{- end }}
{{- if not (kindIs "invalid" $s.prefillBudget) }}
- --prefill-budget
- {{ int $s.prefillBudget | quote }}
{{- end }}
{{- if not (kindIs "invalid" $s.graphMaxBatch) }}
- --graph-max-batch
- {{ int $s.graphMaxBatch | quote }}
{{- end }}
{{- if not (kindIs "invalid" $s.cacheBudgetMb) }}
- --cache-budget-mb
- {{ int $s.cacheBudgetMb | quote }}
{{- end }}
{{- if not $s.preempt }}
- --no-preempt
{{- end }}
{{- if not $s.runAhead }}
- --no-run-ahead
{{- end }}
{{- if .Values.metrics.enabled }}
- --metrics
- {{ printf "0.0.0.0:%d" (int .Values.metrics.port) | quote }}
{{- end }}
{{- if .Values.tls.enabled }}
- --tls-cert
- /etc/metrale/tls/tls.crt
- --tls-key
- /etc/metrale/tls/tls.key
{{- if .Values.tls.clientCA.enabled }}
- --tls-client-ca
- /etc/metrale/tls-client-ca/ca.crt
{{- end }}
- --health-listen
- {{ printf "0.0.0.0:%d" (int $s.healthPort) | quote }}
{{- end }}
{{- if .Values.auth.tokenSecret.name }}
- --auth-token-file
- /etc/metrale/auth/token
{{- end }}
{{- range $s.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The pod's annotations: podAnnotations, plus the prometheus.io ones for the metrics port
(podAnnotations win). */}}
{{- define "metrale.podAnnotations" -}}
{{- $ann := deepCopy (default dict .Values.podAnnotations) }}
{{- if and .Values.metrics.enabled .Values.metrics.podAnnotations }}
{{- $ann = merge $ann (dict "prometheus.io/scrape" "true" "prometheus.io/port" (toString (int .Values.metrics.port)) "prometheus.io/path" "/metrics") }}
{{- end }}
{{- with $ann }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/* The port the gRPC probes use: the plaintext health port with TLS, else the serving port. */}}
{{- define "metrale.probePort" -}}
{{- if .Values.tls.enabled }}
{{- int .Values.serve.healthPort }}
{{- else }}
{{- int .Values.serve.port }}
{{- end }}
{{- end }}

{{/* Container resources: the values' resources plus, on the cuda backend, tp GPUs. */}}
{{- define "metrale.resources" -}}
{{- $res := deepCopy (default dict .Values.resources) }}
{{- $gpu := .Values.gpu.resourceName }}
{{- range $kind := list "requests" "limits" }}
{{- if hasKey (default dict (get $res $kind)) $gpu }}
{{- fail (printf "resources.%s.%s is set from tp on the cuda backend; leave it out of resources" $kind $gpu) }}
{{- end }}
{{- end }}
{{- if eq .Values.backend "cuda" }}
{{- range $kind := list "requests" "limits" }}
{{- $m := default dict (get $res $kind) }}
{{- $_ := set $m $gpu (int $.Values.tp) }}
{{- $_ := set $res $kind $m }}
{{- end }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Every container: non-root, read-only root filesystem, no privilege escalation, no capabilities. */}}
{{- define "metrale.containerSecurityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop:
    - ALL
{{- end }}
