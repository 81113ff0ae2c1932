{{/*
Names, labels and small shared pieces. Worker (prefill/decode) manifests live in _worker.tpl.
*/}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
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

{{/* "<fullname>-<component>", e.g. tandem-decode. Args: dict root, component. */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end }}

{{/* Pod template labels: no version or chart labels, so a chart upgrade that changes nothing
     else does not restart GPU workers (each restart reloads the model for minutes). */}}
{{- define "tandem.podLabels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The routers' headless Service: the autoscaler resolves it and scrapes every router pod
     (headless names resolve to pod IPs, so the port is the container port). */}}
{{- define "tandem.routerMetricsUrl" -}}
{{- printf "http://%s.%s.svc:%v/metrics" (include "tandem.componentName" (dict "root" . "component" "router-pods")) .Release.Namespace .Values.router.port }}
{{- end }}

{{/* httpGet probes on one port. Args: dict probes (values block), port (name or number). */}}
{{- define "tandem.probes" -}}
startupProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: {{ .probes.startup.periodSeconds }}
  failureThreshold: {{ .probes.startup.failureThreshold }}
  timeoutSeconds: {{ .probes.startup.timeoutSeconds }}
livenessProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: {{ .probes.liveness.periodSeconds }}
  failureThreshold: {{ .probes.liveness.failureThreshold }}
  timeoutSeconds: {{ .probes.liveness.timeoutSeconds }}
readinessProbe:
  httpGet: {path: /ready, port: {{ .port }}}
  periodSeconds: {{ .probes.readiness.periodSeconds }}
  failureThreshold: {{ .probes.readiness.failureThreshold }}
  timeoutSeconds: {{ .probes.readiness.timeoutSeconds }}
{{- end }}

{{/* nodeSelector / tolerations / affinity / imagePullSecrets of a pod. Args: dict root, spec. */}}
{{- define "tandem.scheduling" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A PodDisruptionBudget for one component. Args: dict root, component, spec. */}}
{{- define "tandem.pdb" -}}
{{- if .spec.podDisruptionBudget.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  {{- $max := .spec.podDisruptionBudget.maxUnavailable }}
  maxUnavailable: {{ kindIs "string" $max | ternary ($max | quote) $max }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/* The Secret holding the router's API keys: the user's, or the one the chart makes from values. */}}
{{- define "tandem.apiKeysSecret" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "router-api-keys")) .Values.router.apiKeys.existingSecret }}
{{- end }}
