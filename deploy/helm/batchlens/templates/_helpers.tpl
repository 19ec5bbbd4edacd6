{{/* The release's base name, at most 63 characters (a DNS label). */}}
{{- define "batchlens.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "batchlens.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "batchlens.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "batchlens.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: batchlens
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "exporter"). */}}
{{- define "batchlens.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchlens.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "batchlens.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "batchlens.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "batchlens.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
Where kube-prometheus-stack's Prometheus and Alertmanager run: monitoringNamespace, or else the one namespace
whose Service alertmanager-operated the cluster shows (the operator makes it). Rendered without a cluster
(helm template), or with none or several, the chart cannot know, and refuses to guess: a wrong guess renders
NetworkPolicies that block the scrape and the webhook, and pages that go nowhere.
*/}}
{{- define "batchlens.monitoringNamespace" -}}
{{- if .Values.monitoringNamespace -}}
{{- .Values.monitoringNamespace -}}
{{- else -}}
{{- $found := list -}}
{{- range (lookup "v1" "Service" "" "").items | default list -}}
{{- if eq .metadata.name "alertmanager-operated" -}}{{- $found = append $found .metadata.namespace -}}{{- end -}}
{{- end -}}
{{- $found = uniq $found -}}
{{- if eq (len $found) 1 -}}
{{- first $found -}}
{{- else -}}
{{- fail (printf "monitoringNamespace: set it to the namespace kube-prometheus-stack runs in (e.g. --set monitoringNamespace=monitoring; `kubectl get svc -A --field-selector metadata.name=alertmanager-operated` shows it). %s" (ternary (printf "The cluster shows Alertmanagers in %s." (join ", " $found)) "None could be looked up (helm template renders without a cluster)." (gt (len $found) 1))) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* ` --from-literal=<key>="$(openssl rand -hex 20)"` for each of .keys: a Secret with every key the chart reads. */}}
{{- define "batchlens.secretLiterals" -}}
{{- range .keys }} --from-literal={{ . }}="$(openssl rand -hex 20)"{{ end -}}
{{- end -}}

{{- define "batchlens.exporterServiceAccountName" -}}
{{- if .Values.exporter.serviceAccount.create -}}
{{- default (printf "%s-exporter" (include "batchlens.fullname" .)) .Values.exporter.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.exporter.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the engines' admin token, and the one holding the webhook token. */}}
{{- define "batchlens.adminTokenSecret" -}}
{{- default (printf "%s-admin-token" (include "batchlens.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}
{{- define "batchlens.webhookTokenSecret" -}}
{{- default (printf "%s-webhook-token" (include "batchlens.fullname" .)) .Values.remediate.webhookToken.existingSecret -}}
{{- end -}}

{{/* The in-cluster URL Alertmanager posts the breaker alert to. */}}
{{- define "batchlens.webhookUrl" -}}
{{- printf "http://%s-remediate.%s.svc:%d/alertmanager" (include "batchlens.fullname" .) .Release.Namespace (int .Values.remediate.port) -}}
{{- end -}}

{{/* The namespaces that get an AlertmanagerConfig (the operator matches alerts to its own namespace): the
engines' own, where their series and so their alerts are labelled; the release's with no engine anywhere. */}}
{{- define "batchlens.alertNamespaces" -}}
{{- $namespaces := include "batchlens.adminTokenNamespaces" . | fromJsonArray -}}
{{- toJson ($namespaces | default (list .Release.Namespace)) -}}
{{- end -}}

{{/*
A token for a Secret the chart creates: the value given, else the one already in the cluster (so an upgrade
keeps it), else a new random one. Rendered with no cluster to ask (helm template, every GitOps render), a
random token would be new on every render: there it is "", and the Secret is rendered without it, for the
remediation service to fill at start (batchlens.fillSecrets). Call with (dict "root" $ "name" <secret> "key"
<key> "value" <value>), and "namespace" where the Secret is not in the release's namespace.
*/}}
{{- define "batchlens.keptToken" -}}
{{- if .value -}}
{{- .value -}}
{{- else -}}
{{- $found := lookup "v1" "Secret" (.namespace | default .root.Release.Namespace) .name -}}
{{- $data := dig "data" .key "" ($found | default dict) -}}
{{- if $data -}}{{- $data | b64dec -}}{{- else if not (include "batchlens.offline" .root) -}}{{- randAlphaNum 40 -}}{{- end -}}
{{- end -}}
{{- end -}}

{{/* "true" when no cluster answers lookups (helm template, a GitOps render). Every namespace has the
ServiceAccount "default", and whoever may install into the namespace may read it. */}}
{{- define "batchlens.offline" -}}
{{- if not (lookup "v1" "ServiceAccount" .Release.Namespace "default") -}}true{{- end -}}
{{- end -}}

{{/* The Secrets the chart creates whose tokens it leaves out (batchlens.keptToken gave ""), as a JSON list
of {namespace, name, keys}: the remediation service writes them at start (kubernetes.fill_secrets). */}}
{{- define "batchlens.fillSecrets" -}}
{{- $fills := list -}}
{{- /* The service is the one that writes: without it, nothing is left to fill (the NOTES say so). */ -}}
{{- if and (not .Values.adminToken.existingSecret) .Values.remediate.enabled -}}
{{- $name := include "batchlens.adminTokenSecret" . -}}
{{- range $namespace := include "batchlens.adminTokenNamespaces" . | fromJsonArray -}}
{{- $keys := list -}}
{{- range $key := list $.Values.adminToken.key $.Values.adminToken.webhookKey -}}
{{- $value := ternary $.Values.adminToken.value "" (eq $key $.Values.adminToken.key) -}}
{{- if not (include "batchlens.keptToken" (dict "root" $ "name" $name "namespace" $namespace "key" $key "value" $value)) -}}
{{- $keys = append $keys $key -}}
{{- end -}}
{{- end -}}
{{- if $keys -}}{{- $fills = append $fills (dict "namespace" $namespace "name" $name "keys" $keys) -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.remediate.enabled (not .Values.remediate.webhookToken.existingSecret) -}}
{{- $name := include "batchlens.webhookTokenSecret" . -}}
{{- $key := .Values.remediate.webhookToken.key -}}
{{- if not (include "batchlens.keptToken" (dict "root" . "name" $name "key" $key "value" .Values.remediate.webhookToken.value)) -}}
{{- $fills = append $fills (dict "namespace" .Release.Namespace "name" $name "keys" (list $key)) -}}
{{- end -}}
{{- end -}}
{{- toJson $fills -}}
{{- end -}}

{{/* The keys a Secret leaves to the service: call with (dict "root" $ "namespace" <ns> "name" <secret>). */}}
{{- define "batchlens.keysToFill" -}}
{{- $keys := list -}}
{{- range include "batchlens.fillSecrets" .root | fromJsonArray -}}
{{- if and (eq .namespace $.namespace) (eq .name $.name) -}}{{- $keys = .keys -}}{{- end -}}
{{- end -}}
{{- toJson $keys -}}
{{- end -}}

{{/* A label selector as kubectl writes it: k=v,k2=v2. */}}
{{- define "batchlens.selector" -}}
{{- $terms := list -}}
{{- range $key, $value := . }}{{ $terms = append $terms (printf "%s=%s" $key $value) }}{{ end -}}
{{- join "," $terms -}}
{{- end -}}

{{/*
The namespaces whose vLLM pods may be engines: required with discovery, since a label alone proves nothing on
a shared cluster (docs/kubernetes.md, "What makes a pod an engine").
*/}}
{{- define "batchlens.engineNamespaces" -}}
{{- if .Values.discovery.enabled -}}
{{- if not .Values.discovery.namespaces -}}
{{- fail "discovery.namespaces: list the namespaces whose vLLM pods are engines (e.g. --set discovery.namespaces={serving}); a label alone proves nothing on a shared cluster, docs/kubernetes.md" -}}
{{- end -}}
{{- toJson (uniq .Values.discovery.namespaces) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/*
Where the admin token Secret lives: each engine namespace (a discovered pod takes its token from its own
namespace's Secret, and batchlens reads it there), and the release's namespace when `engines` lists static
ones (the exporter and the hook take their token from the environment).
*/}}
{{- define "batchlens.adminTokenNamespaces" -}}
{{- $namespaces := include "batchlens.engineNamespaces" . | fromJsonArray -}}
{{- if .Values.engines -}}{{- $namespaces = append $namespaces .Release.Namespace -}}{{- end -}}
{{- toJson (uniq $namespaces) -}}
{{- end -}}

{{/* The labels that select the vLLM pods. */}}
{{- define "batchlens.vllmSelector" -}}
{{- toJson (.Values.discovery.selector | default (dict "app.kubernetes.io/name" "vllm")) -}}
{{- end -}}
