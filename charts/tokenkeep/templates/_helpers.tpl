{{- define "tokenkeep.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tokenkeep.selectorLabels" -}}
app.kubernetes.io/name: tokenkeep-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tokenkeep.labels" -}}
{{ include "tokenkeep.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tokenkeep
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tokenkeep.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tokenkeep.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tokenkeep.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* What the operator may do to the resources it manages, in any watched namespace.
Owner references with blockOwnerDeletion need `update` on the owner's finalizers, and
adding or removing an owner reference needs `delete` on the child, where the
OwnerReferencesPermissionEnforcement admission plugin is on (OpenShift has it by default). */}}
{{- define "tokenkeep.namespacedRules" -}}
- apiGroups: ["tokenkeep.dev"]
  resources: ["modelservers", "sessionservers"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["tokenkeep.dev"]
  resources: ["modelservers/status", "sessionservers/status"]
  verbs: ["get", "patch"]
- apiGroups: ["tokenkeep.dev"]
  resources: ["modelservers/finalizers", "sessionservers/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Secrets: create, for each SessionServer's generated admin key and each ModelServer's
# engine key; get (never list or watch), with rbac.readAdminKeys, to read one SessionServer's
# admin key by name and ask its server GET /policy for the status. The operator hands no key
# to anyone: admins read them from the Secrets.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: {{ if .Values.rbac.readAdminKeys }}["create", "get"]{{ else }}["create"]{{ end }}
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# NetworkPolicies: the engines' and the managed Redis'; `delete` also removes one whose
# resource turned spec.networkPolicy.enabled off.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Multi-node engines (ModelServer parallelism.nodes > 1): one LeaderWorkerSet each; `delete`
# also removes one whose ModelServer went back to one node. Harmless where LWS is not installed.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Read-only: pod states explain why a rollout is stuck (missing secret, no GPU, ...).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
