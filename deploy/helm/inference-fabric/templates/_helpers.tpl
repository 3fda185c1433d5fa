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
