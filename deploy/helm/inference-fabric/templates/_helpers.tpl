{{/* Object names: "<release>-<tier>". */}}
{{- define "fabric.prefix" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels; call with (dict "root" $ "component" "gateway"). */}}
{{- define "fabric.selectorLabels" -}}
app.kubernetes.io/name: inference-fabric
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every label of an object; same call. */}}
{{- define "fabric.labels" -}}
{{ include "fabric.selectorLabels" . }}
app.kubernetes.io/part-of: inference-fabric
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* A role's image; call with (dict "root" $ "role" "gateway"|"router"|"worker"). */}}
{{- define "fabric.image" -}}
{{- $image := .root.Values.image -}}
{{- $repository := index $image.repositories .role -}}
{{- with $image.registry }}{{ trimSuffix "/" . }}/{{ end -}}
{{ $repository }}:{{ $image.tag | default .root.Chart.AppVersion }}
{{- end -}}

{{/* The Secret holding api-keys.toml: the given one, or the one the chart creates. */}}
{{- define "fabric.apiKeysSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-gateway-api-keys" (include "fabric.prefix" .)) -}}
{{- end -}}

{{/* The Secret holding Redis's users.acl and each role's password: given, or chart-made. */}}
{{- define "fabric.redisAclSecret" -}}
{{- .Values.redisAuth.existingSecret | default (printf "%s-redis-acl" (include "fabric.prefix" .)) -}}
{{- end -}}

{{/* Whether the cluster serves the Prometheus Operator's CRDs and ServiceMonitors are wanted. */}}
{{- define "fabric.serviceMonitors" -}}
{{- if and .Values.serviceMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}
true
{{- end -}}
{{- end -}}

{{/* A native gRPC probe; call with (dict "port" 8001 "probe" .Values.gateway.probes.startup). */}}
{{- define "fabric.grpcProbe" -}}
grpc:
  port: {{ .port }}
  service: {{ .probe.service | quote }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end -}}

{{/* startup/readiness/liveness of a tier; call with (dict "port" .. "probes" ..). */}}
{{- define "fabric.probes" -}}
startupProbe:
  {{- include "fabric.grpcProbe" (dict "port" .port "probe" .probes.startup) | nindent 2 }}
readinessProbe:
  {{- include "fabric.grpcProbe" (dict "port" .port "probe" .probes.readiness) | nindent 2 }}
livenessProbe:
  {{- include "fabric.grpcProbe" (dict "port" .port "probe" .probes.liveness) | nindent 2 }}
{{- end -}}

{{/* An HTTP probe of the `metrics` port, for a tier without gRPC health (the job runner); call
with the probe's values (periodSeconds, timeoutSeconds, failureThreshold). */}}
{{- define "fabric.metricsProbe" -}}
httpGet:
  port: metrics
  path: /metrics
periodSeconds: {{ .periodSeconds }}
timeoutSeconds: {{ .timeoutSeconds }}
failureThreshold: {{ .failureThreshold }}
{{- end -}}

{{/* Rolls the pods when the shared settings change. */}}
{{- define "fabric.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{/* The Secret volume of a tier's TLS material; call with (dict "root" $ "component" "router"). */}}
{{- define "fabric.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ .root.Values.tls.secretPrefix }}-{{ .component }}
    defaultMode: 0440
{{- end -}}

{{/* A tier's Redis password (only its own role's key) as /etc/fabric/redis/password; call with
(dict "root" $ "role" "router"). */}}
{{- define "fabric.redisCredentialsVolume" -}}
- name: redis-credentials
  secret:
    secretName: {{ include "fabric.redisAclSecret" .root }}
    items:
      - key: {{ .role }}-password
        path: password
{{- end -}}

{{/* Worker pools: each template ranges over `.Values.workerPools | default (list dict)`, where the
one empty pool stands for today's single "<release>-gpu-worker" serving every model. */}}

{{/* A worker pool's name suffix ("" for that unnamed pool); call with the pool. */}}
{{- define "fabric.poolSuffix" -}}
{{- with .name }}-{{ . }}{{ end -}}
{{- end -}}

{{/* A worker pool's selector labels: the tier's, plus inference-fabric/pool for a named pool,
so no pool's selector reaches another's pods; call with (dict "root" $ "pool" $pool). */}}
{{- define "fabric.workerSelectorLabels" -}}
{{ include "fabric.selectorLabels" (dict "root" .root "component" "gpu-worker") }}
{{- with .pool.name }}
inference-fabric/pool: {{ . }}
{{- end }}
{{- end -}}

{{/* Every label of a worker pool's objects; same call. */}}
{{- define "fabric.workerLabels" -}}
{{ include "fabric.labels" (dict "root" .root "component" "gpu-worker") }}
{{- with .pool.name }}
inference-fabric/pool: {{ . }}
{{- end }}
{{- end -}}

{{/* Where gateways and workers read the model repository (the image's; a volume mounted there
hides it). */}}
{{- define "fabric.modelRepositoryPath" -}}
/app/models
{{- end -}}

{{/* The model repository's volume, for modelRepository.source pvc or init (nothing for image);
call with $. */}}
{{- define "fabric.modelRepositoryVolume" -}}
{{- $repo := .Values.modelRepository -}}
{{- if eq $repo.source "pvc" }}
{{- if not $repo.pvc.claimName }}
{{- fail "modelRepository.source=pvc needs modelRepository.pvc.claimName" }}
{{- end }}
- name: model-repository
  persistentVolumeClaim:
    claimName: {{ $repo.pvc.claimName }}
    readOnly: true
{{- else if eq $repo.source "init" }}
- name: model-repository
  emptyDir:
    sizeLimit: {{ $repo.init.sizeLimit }}
{{- end }}
{{- end -}}

{{/* The main container's mount of that volume, read-only at the repository path; call with $. */}}
{{- define "fabric.modelRepositoryMount" -}}
{{- $repo := .Values.modelRepository -}}
{{- if ne $repo.source "image" }}
- name: model-repository
  mountPath: {{ include "fabric.modelRepositoryPath" . }}
  readOnly: true
  {{- if and (eq $repo.source "pvc") $repo.pvc.subPath }}
  subPath: {{ $repo.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* For modelRepository.source=init: the init container that fills the repository volume
before the tier starts; call with (dict "root" $ "role" "gateway"|"worker" "models" list). It
is told where (MODEL_REPOSITORY), for whom (FABRIC_ROLE) and which models (FABRIC_MODELS,
comma-separated; "" = all): a gateway needs every model's config and tokenizer, not weights. */}}
{{- define "fabric.modelRepositoryInit" -}}
{{- $root := .root -}}
{{- $init := $root.Values.modelRepository.init -}}
{{- if eq $root.Values.modelRepository.source "init" }}
{{- if not (and $init.image $init.command) }}
{{- fail "modelRepository.source=init needs modelRepository.init.image and .command" }}
{{- end }}
initContainers:
  - name: fetch-models
    image: {{ $init.image }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command:
      {{- toYaml $init.command | nindent 6 }}
    env:
      - name: MODEL_REPOSITORY
        value: {{ include "fabric.modelRepositoryPath" $root }}
      - name: FABRIC_ROLE
        value: {{ .role }}
      - name: FABRIC_MODELS
        value: {{ join "," .models | quote }}
      {{- with $init.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    resources:
      {{- toYaml $init.resources | nindent 6 }}
    securityContext:
      {{- toYaml $root.Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      - name: model-repository
        mountPath: {{ include "fabric.modelRepositoryPath" $root }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end -}}
