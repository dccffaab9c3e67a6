{{/* Names, labels and the pieces several templates share. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* release-chart, or the release name alone when it already contains the chart name. Kept
short: KubeRay appends "-head-svc" and worker-group suffixes to the RayCluster's name. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "router"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The RayCluster's name; KubeRay labels its pods ray.io/cluster=<this>. */}}
{{- define "pdserve.rayCluster" -}}
{{- include "pdserve.fullname" . }}
{{- end }}

{{- define "pdserve.routerName" -}}
{{- printf "%s-router" (include "pdserve.fullname" .) }}
{{- end }}

{{- define "pdserve.redisName" -}}
{{- printf "%s-redis" (include "pdserve.fullname" .) }}
{{- end }}

{{/* image reference: include with an images.* entry. */}}
{{- define "pdserve.image" -}}
{{- if .digest }}{{ printf "%s@%s" .repository .digest }}{{ else }}{{ printf "%s:%s" .repository .tag }}{{ end }}
{{- end }}

{{/* The Redis URL without its password (the password travels in PDSERVE_REDIS_PASSWORD). */}}
{{- define "pdserve.redisUrl" -}}
{{- if eq .Values.redis.mode "builtin" }}
{{- printf "redis://%s:6379/0" (include "pdserve.redisName" .) }}
{{- else }}
{{- required "redis.external.url is required when redis.mode is external" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* The Secret and key holding the Redis password; empty name: none. */}}
{{- define "pdserve.redisSecretName" -}}
{{- if eq .Values.redis.mode "builtin" }}
{{- default (include "pdserve.redisName" .) .Values.redis.builtin.existingSecret }}
{{- else }}
{{- .Values.redis.external.passwordSecret.name }}
{{- end }}
{{- end }}

{{- define "pdserve.redisSecretKey" -}}
{{- if eq .Values.redis.mode "builtin" }}password{{ else }}{{ .Values.redis.external.passwordSecret.key }}{{ end }}
{{- end }}

{{/* env entries every pdserve process that talks to Redis needs. */}}
{{- define "pdserve.redisEnv" -}}
{{- $secret := include "pdserve.redisSecretName" . }}
{{- if $secret }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "pdserve.redisSecretKey" . }}
{{- end }}
{{- end }}

{{/* The Ray token for processes that join the cluster from outside KubeRay's own container. */}}
{{- define "pdserve.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ default (include "pdserve.rayCluster" .) .Values.ray.auth.existingSecret }}
      key: auth_token
{{- end }}
{{- end }}

{{/* Where the model's files are inside a pod, and the --model a node gets. */}}
{{- define "pdserve.nodeModel" -}}
{{- if eq .Values.model.source "builtin" }}
{{- .Values.model.builtin.name }}
{{- else if eq .Values.model.source "pvc" }}
{{- printf "/models/%s" (required "model.pvc.path is required when model.source is pvc" .Values.model.pvc.path | trimPrefix "/") }}
{{- else }}
{{- "/models/model" }}
{{- end }}
{{- end }}

{{/* Volumes of a pod that reads the model: `cache` (PDSERVE_CACHE_DIR: the builtin model's
conversion, CPU kernel plans) always, `model` for a PVC or a download. */}}
{{- define "pdserve.modelVolumes" -}}
- name: cache
  emptyDir: {}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "download" }}
- name: model
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit }}
{{- end }}
{{- end }}

{{- define "pdserve.modelMounts" -}}
- name: cache
  mountPath: /cache
{{- if ne .Values.model.source "builtin" }}
- name: model
  mountPath: /models
  readOnly: {{ eq .Values.model.source "pvc" }}
{{- end }}
{{- end }}

{{/* An init container that puts the model (or, with tokenizerOnly, its tokenizer) into the
model volume: include with (dict "ctx" $ "tokenizerOnly" true). None for a PVC. */}}
{{- define "pdserve.modelInit" -}}
{{- $v := .ctx.Values }}
{{- if ne $v.model.source "pvc" }}
- name: prepare-model
  image: {{ include "pdserve.image" $v.images.tools }}
  imagePullPolicy: {{ $v.images.tools.pullPolicy }}
  command: ["pdserve", "prepare-model"]
  args:
    {{- if eq $v.model.source "builtin" }}
    - {{ $v.model.builtin.name | quote }}
    - /cache/tokenizer
    {{- else }}
    - {{ printf "hf:%s" (required "model.download.repo is required when model.source is download" $v.model.download.repo) | quote }}
    - /models/model
    - --revision
    - {{ $v.model.download.revision | quote }}
    {{- end }}
    {{- if .tokenizerOnly }}
    - --tokenizer-only
    {{- end }}
  env:
    - name: PDSERVE_CACHE_DIR
      value: /cache
    {{- if eq $v.model.source "download" }}
    - name: HF_HUB_OFFLINE
      value: "0"
    {{- if $v.model.download.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $v.model.download.tokenSecret.name }}
          key: {{ $v.model.download.tokenSecret.key }}
    {{- end }}
    {{- end }}
  volumeMounts:
    {{- include "pdserve.scratchMounts" .ctx | nindent 4 }}
    {{- include "pdserve.modelMounts" .ctx | nindent 4 }}
  securityContext:
    {{- include "pdserve.containerSecurity" .ctx | nindent 4 }}
{{- end }}
{{- end }}

{{/* The router's tokenizer directory, where modelInit (or the PVC) put it. */}}
{{- define "pdserve.tokenizerDir" -}}
{{- if eq .Values.model.source "builtin" }}/cache/tokenizer{{ else }}{{ include "pdserve.nodeModel" . }}{{ end }}
{{- end }}

{{- define "pdserve.podSecurity" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "pdserve.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* With a read-only root filesystem, what pdserve, Ray, Python and gcc write goes to emptyDirs:
/tmp (Ray's session under /tmp/ray, compiler and tempfile scratch) and the home directory
(~/.cache, ~/.ray). The model cache (/cache) and /models are modelVolumes. */}}
{{- define "pdserve.homeDir" -}}/home/pdserve{{- end }}

{{- define "pdserve.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end }}

{{- define "pdserve.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: {{ include "pdserve.homeDir" . }}
{{- end }}

{{/* The disk KV tier (engine.diskCache): mounted at the same path on every worker pod, so the
--disk-cache-dir the supervisor passes holds wherever Ray places a node. */}}
{{- define "pdserve.kvCacheDir" -}}
/kv-cache
{{- end }}

{{- define "pdserve.kvCacheVolumes" -}}
{{- $d := .Values.engine.diskCache }}
{{- if $d.mib }}
- name: kv-cache
{{- if $d.claimName }}
  persistentVolumeClaim:
    claimName: {{ $d.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $d.sizeLimit }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.kvCacheMounts" -}}
{{- if .Values.engine.diskCache.mib }}
- name: kv-cache
  mountPath: {{ include "pdserve.kvCacheDir" . }}
{{- end }}
{{- end }}

{{/* `pdserve nodes` engine flags, from .Values.engine (one to one with `pdserve up`'s). */}}
{{- define "pdserve.engineArgs" -}}
{{- $e := .Values.engine }}
- --model
- {{ include "pdserve.nodeModel" . | quote }}
- --dtype
- {{ $e.dtype }}
- --block-size
- {{ $e.blockSize | int | quote }}
- --kv-cache-mib
- {{ $e.kvCacheMiB | int | quote }}
{{- if $e.hostCacheMiB }}
- --host-cache-mib
- {{ $e.hostCacheMiB | quote }}
{{- end }}
{{- if $e.diskCache.mib }}
- --disk-cache-dir
- {{ include "pdserve.kvCacheDir" . }}
- --disk-cache-mib
- {{ $e.diskCache.mib | quote }}
{{- end }}
- --max-num-batched-tokens
- {{ $e.maxNumBatchedTokens | int | quote }}
- --max-num-seqs
- {{ $e.maxNumSeqs | int | quote }}
{{- if $e.threads }}
- --threads
- {{ $e.threads | int | quote }}
{{- end }}
{{- if not $e.prefixCaching }}
- --no-prefix-caching
{{- end }}
- --spec-method
- {{ $e.specMethod | quote }}
- --spec-tokens
- {{ $e.specTokens | int | quote }}
- --prefill-tensor-parallel
- {{ .Values.prefill.tensorParallel | default 1 | int | quote }}
- --decode-tensor-parallel
- {{ .Values.decode.tensorParallel | default 1 | int | quote }}
{{- with .Values.prefill.stepTokens }}
- --prefill-step-tokens
- {{ . | int | quote }}
{{- end }}
{{- if gt (int .Values.prefill.gpu.count) 0 }}
- --prefill-gpu
{{- end }}
{{- with .Values.prefill.gpu.type }}
- --prefill-accelerator-type
- {{ . | quote }}
{{- end }}
{{- if gt (int .Values.decode.gpu.count) 0 }}
- --decode-gpu
{{- end }}
{{- with .Values.decode.gpu.type }}
- --decode-accelerator-type
- {{ . | quote }}
{{- end }}
{{- range $e.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* TLS (docs/security.md): one Secret, mounted at the same path on the router and every
worker pod, so the file paths a node config carries hold on whichever pod Ray places it. */}}
{{/* How long a worker pod's preStop waits for its node to drain and exit: the node's drain
timeout plus time to leave the index and end the actor. */}}
{{- define "pdserve.nodePreStopSeconds" -}}
{{- add (ceil .Values.nodes.drainSeconds | int) 15 }}
{{- end }}

{{- define "pdserve.tlsDir" -}}/etc/pdserve/tls{{- end }}

{{- define "pdserve.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert-file
- {{ printf "%s/tls.crt" (include "pdserve.tlsDir" .) | quote }}
- --tls-key-file
- {{ printf "%s/tls.key" (include "pdserve.tlsDir" .) | quote }}
- --tls-ca-file
- {{ printf "%s/ca.crt" (include "pdserve.tlsDir" .) | quote }}
- --tls-server-name
- {{ .Values.tls.serverName | quote }}
{{- end }}
{{- end }}

{{/* A router probe when clients must present a certificate (tls.clientAuth): the kubelet's
httpGet presents none, so the pod asks itself over HTTPS with its own member certificate
(signed by the same CA). Exit status non-zero on any failure, 503 included. */}}
{{- define "pdserve.routerProbeExec" -}}
{{- $d := include "pdserve.tlsDir" .ctx -}}
exec:
  command:
    - python
    - -c
    - >-
      import ssl, sys, urllib.request;
      c = ssl.create_default_context(cafile=sys.argv[1] + "/ca.crt");
      c.check_hostname = False;
      c.load_cert_chain(sys.argv[1] + "/tls.crt", sys.argv[1] + "/tls.key");
      urllib.request.urlopen(sys.argv[2], context=c, timeout=5)
    - {{ $d | quote }}
    - {{ printf "https://127.0.0.1:%v%s" (.ctx.Values.router.httpPort | int) .path | quote }}
timeoutSeconds: 6
{{- end }}

{{/* The Secret with tls.crt, tls.key and ca.crt: the operator's (tls.secretName), else the
chart's own, which cert-manager or the secrets hook fills (pdserve.tlsProvider). */}}
{{- define "pdserve.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "pdserve.fullname" .)) .Values.tls.secretName }}
{{- end }}

{{/* Who makes the chart's TLS Secret: "" (TLS off, or tls.secretName given: nobody),
"certManager" (Certificates of a release CA) or "generated" (the secrets hook). `auto` takes
cert-manager when its API is installed; `helm template` without --api-versions sees none. */}}
{{- define "pdserve.tlsProvider" -}}
{{- $t := .Values.tls }}
{{- if and $t.enabled (not $t.secretName) }}
{{- if eq $t.provider "auto" }}
{{- if .Capabilities.APIVersions.Has "cert-manager.io/v1" }}certManager{{ else }}generated{{ end }}
{{- else }}
{{- $t.provider }}
{{- end }}
{{- end }}
{{- end }}

{{/* The names every member's certificate carries: the one members verify each other
against, the router's Service (in-cluster clients) and loopback (port-forward, probes). */}}
{{- define "pdserve.tlsDnsNames" -}}
{{- $svc := include "pdserve.routerName" . }}
- {{ .Values.tls.serverName | quote }}
- {{ $svc | quote }}
- {{ printf "%s.%s" $svc .Release.Namespace | quote }}
- {{ printf "%s.%s.svc" $svc .Release.Namespace | quote }}
- {{ printf "%s.%s.svc.cluster.local" $svc .Release.Namespace | quote }}
- "localhost"
{{- end }}

{{- define "pdserve.tlsVolumes" -}}
{{- if .Values.tls.enabled }}
- name: pdserve-tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" . }}
    defaultMode: 0440  # group-readable: fsGroup makes the pod user its group
{{- end }}
{{- end }}

{{- define "pdserve.tlsMounts" -}}
{{- if .Values.tls.enabled }}
- name: pdserve-tls
  mountPath: {{ include "pdserve.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The cluster token (docs/security.md, "Prefix fetch"): the secret every node signs its
node-to-node prefix fetches with, so a peer that is not a member can neither serve KV to a
node nor make a holder probe, pin or dial. Mounted on the supervisor and every worker pod at
one path; the operator's Secret (nodes.clusterToken.name and .key) or the hook's. */}}
{{- define "pdserve.clusterTokenSecretName" -}}
{{- default (printf "%s-cluster-token" (include "pdserve.fullname" .)) .Values.nodes.clusterToken.name }}
{{- end }}

{{- define "pdserve.clusterTokenDir" -}}/etc/pdserve/cluster-token{{- end }}

{{- define "pdserve.clusterTokenArgs" -}}
{{- if .Values.nodes.clusterToken.enabled }}
- --cluster-token-file
- {{ printf "%s/%s" (include "pdserve.clusterTokenDir" .) (ternary .Values.nodes.clusterToken.key "token" (ne .Values.nodes.clusterToken.name "")) | quote }}
{{- end }}
{{- end }}

{{- define "pdserve.clusterTokenVolumes" -}}
{{- if .Values.nodes.clusterToken.enabled }}
- name: pdserve-cluster-token
  secret:
    secretName: {{ include "pdserve.clusterTokenSecretName" . }}
    defaultMode: 0440  # group-readable: fsGroup makes the pod user its group
{{- end }}
{{- end }}

{{- define "pdserve.clusterTokenMounts" -}}
{{- if .Values.nodes.clusterToken.enabled }}
- name: pdserve-cluster-token
  mountPath: {{ include "pdserve.clusterTokenDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The Secret holding the router's API keys: the operator's (apiKey.name), else the one the
secrets hook makes at install. */}}
{{- define "pdserve.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "pdserve.fullname" .)) .Values.apiKey.name }}
{{- end }}

{{/* The router's API keys, from their Secret (never a value or an argument). */}}
{{- define "pdserve.apiKeyEnv" -}}
{{- if .Values.apiKey.enabled }}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.apiKeySecretName" . }}
      key: {{ .Values.apiKey.key }}
{{- end }}
{{- end }}

{{/* The Secrets the pre-install/pre-upgrade hook creates when absent
(templates/secrets-hook.yaml), by kind: a YAML mapping, empty when there is nothing to create.
An operator's existing Secret is never one. */}}
{{- define "pdserve.hookSecrets" -}}
{{- if and (eq .Values.redis.mode "builtin") (not .Values.redis.builtin.existingSecret) }}
redis: {{ include "pdserve.redisName" . }}
{{- end }}
{{- if and .Values.apiKey.enabled (not .Values.apiKey.name) }}
apiKey: {{ include "pdserve.apiKeySecretName" . }}
{{- end }}
{{- if eq (include "pdserve.tlsProvider" .) "generated" }}
tls: {{ include "pdserve.tlsSecretName" . }}
{{- end }}
{{- if and .Values.nodes.clusterToken.enabled (not .Values.nodes.clusterToken.name) }}
clusterToken: {{ include "pdserve.clusterTokenSecretName" . }}
{{- end }}
{{- end }}

{{/* Where KubeRay's GCS fault tolerance finds the release's Redis: host:port, with rediss://
kept for TLS (Ray reads that prefix); "" when off. */}}
{{- define "pdserve.gcsRedisAddress" -}}
{{- if .Values.ray.gcsFaultTolerance.enabled }}
{{- if eq .Values.redis.mode "builtin" }}
{{- printf "%s:6379" (include "pdserve.redisName" .) }}
{{- else }}
{{- $u := urlParse (include "pdserve.redisUrl" .) }}
{{- $host := ternary $u.host (printf "%s:6379" $u.host) (contains ":" $u.host) }}
{{- if eq $u.scheme "rediss" }}{{ printf "rediss://%s" $host }}{{ else }}{{ $host }}{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The private CA of an external rediss:// Redis (the URL's ssl_ca_certs, a file under the
mounted TLS Secret) for Ray's GCS, which reads it from RAY_REDIS_CA_CERT. */}}
{{- define "pdserve.gcsRedisEnv" -}}
{{- if and .Values.ray.gcsFaultTolerance.enabled (eq .Values.redis.mode "external") }}
{{- $ca := regexFind "ssl_ca_certs=[^&]*" (urlParse (include "pdserve.redisUrl" .)).query | trimPrefix "ssl_ca_certs=" }}
{{- with $ca }}
- name: RAY_REDIS_CA_CERT
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
