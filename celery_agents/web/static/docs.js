// Swagger UI for /openapi.json, from files served by this server (no CDN, no inline script).
window.addEventListener("load", function () {
  "use strict";
  window.SwaggerUIBundle({ url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true });
});
